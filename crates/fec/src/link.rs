//! One far-link session, sans-IO: a reliable, ordered byte stream in each direction over
//! datagrams (UDP in the shell), carried in FEC groups ([`Encoder`], [`Decoder`]), paced to
//! the link's rate, with cumulative acknowledgements, requests for what FEC could not rebuild,
//! a retransmission timer for a lost tail, a window that bounds what is in flight, and a
//! count of the stream bytes that are *protected on the wire*: every data and repair packet of
//! their group has left (what the network-sync acknowledgement waits for).
//!
//! Every datagram: `magic u32 | kind u8 | session u64 | time_us u64 | echo_us u64 |
//! echo_delay_us u32 | body | crc32c u32` (little-endian; the checksum covers all before it).
//! `time_us` is the sender's clock; `echo_us` the newest `time_us` it heard from the peer and
//! `echo_delay_us` how long ago: each side measures the round trip from what the other echoes.
//! Bodies: `Open` (client → server, `r u8, c u8, payload_bytes u16`), `Opened` (empty), `Fec`
//! (a [`Packet`]), `Ack` (`next_group u64, count u16, count × (group u64, have u64)`: every
//! group before `next_group` delivered, and the ones named incomplete, with the data packets
//! present as bits) and `Close` (a UTF-8 reason).

use std::collections::{BTreeMap, VecDeque};

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::code::ErasureCode;
use crate::group::{Decoder, Encoder, FecError, Packet, RESEND_GROUPS_MAX};
use crate::pacer::Pacer;

/// "SFFL": StarFish far link.
pub const MAGIC: u32 = 0x5346_464c;
/// Link header and trailer bytes around a body.
pub const OVERHEAD_BYTES: usize = 4 + 1 + 8 + 8 + 8 + 4 + 4;
/// FEC packet header bytes inside the body.
const FEC_HEADER_BYTES: usize = crate::group::HEADER_BYTES;
/// Requests for incomplete groups carried by one acknowledgement at most.
const NACKS_PER_ACK_MAX: usize = 64;
/// Groups resent by one firing of the retransmission timer at most.
const RTO_GROUPS_MAX: usize = 32;
/// Unacknowledged groups at most (the encoder keeps this many and more for resending).
const UNACKED_GROUPS_MAX: usize = RESEND_GROUPS_MAX / 2;
/// An acknowledgement waits this long for more arrivals to cover, µs.
const ACK_DELAY_US: u64 = 1_000;
/// With nothing else to say, each side sends an acknowledgement this often (keepalive), µs.
const KEEPALIVE_US: u64 = 500_000;
/// An opening client repeats its `Open` this often, µs.
const OPEN_RETRY_US: u64 = 200_000;
/// The retransmission timer never fires sooner than this, or later than `RTO_MAX_US`.
const RTO_MIN_US: u64 = 20_000;
const RTO_MAX_US: u64 = 2_000_000;
/// Before any round trip is measured.
const RTT_INITIAL_US: u64 = 200_000;
/// The receive buffer bound, beyond which arrivals of new groups are dropped (they are sent
/// again): the reader is not keeping up.
const RECEIVE_BUFFER_BYTES_MAX: usize = 16 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkConfig {
    /// Data packets per FEC group.
    pub r: u8,
    /// Repair packets per FEC group (0: none; losses are only resent).
    pub c: u8,
    /// Pacing rate of everything this side sends, bytes/s (0: unpaced).
    pub rate_bytes_per_s: u64,
    /// Stream bytes per data packet (the datagram adds `OVERHEAD_BYTES` and the FEC header).
    pub payload_bytes: usize,
    /// Stream bytes written but not yet acknowledged, at most.
    pub window_bytes: usize,
    /// The peer is declared gone after this long without a datagram from it, µs.
    pub idle_timeout_us: u64,
}

impl Default for LinkConfig {
    fn default() -> LinkConfig {
        LinkConfig {
            r: crate::DEFAULT_DATA_PER_GROUP,
            c: crate::DEFAULT_REPAIR_PER_GROUP,
            rate_bytes_per_s: 0,
            // A 1 500-byte MTU path: 1 500 − 28 (IP, UDP) − link overhead − FEC header.
            payload_bytes: 1_500 - 28 - OVERHEAD_BYTES - FEC_HEADER_BYTES - 4,
            window_bytes: 8 << 20,
            idle_timeout_us: 10_000_000,
        }
    }
}

impl LinkConfig {
    pub fn check(&self) -> Result<(), String> {
        if self.r == 0 || self.r as usize + self.c as usize > 64 {
            return Err(format!("FEC ({}, {}): need 1 ≤ r and r + c ≤ 64", self.r, self.c));
        }
        if !(256..=crate::group::PAYLOAD_BYTES_MAX).contains(&self.payload_bytes) {
            return Err(format!("payload of {} bytes per packet: need 256 to 65000", self.payload_bytes));
        }
        if self.window_bytes < self.payload_bytes * self.r as usize {
            return Err("the window must hold at least one group".into());
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Open = 1,
    Opened = 2,
    Fec = 3,
    Ack = 4,
    Close = 5,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Open,
            2 => Kind::Opened,
            3 => Kind::Fec,
            4 => Kind::Ack,
            5 => Kind::Close,
            _ => return None,
        })
    }
}

/// A datagram's header, checked (magic, checksum, kind), with its body.
#[derive(Debug)]
pub struct Datagram {
    kind: Kind,
    pub session: u64,
    time_us: u64,
    echo_us: u64,
    echo_delay_us: u32,
    body: Bytes,
}

impl Datagram {
    /// Parse and check one datagram; anything else on the port is refused with the reason.
    pub fn parse(datagram: &[u8]) -> Result<Datagram, FecError> {
        if datagram.len() < OVERHEAD_BYTES {
            return Err(FecError::Malformed("shorter than a far-link header"));
        }
        let (covered, crc) = datagram.split_at(datagram.len() - 4);
        if u32::from_le_bytes(crc.try_into().expect("4 bytes")) != crc32c::crc32c(covered) {
            return Err(FecError::Malformed("bad checksum (not a far-link datagram, or damaged)"));
        }
        let mut b = covered;
        if b.get_u32_le() != MAGIC {
            return Err(FecError::Malformed("bad magic"));
        }
        let kind = Kind::from_u8(b.get_u8()).ok_or(FecError::Malformed("unknown far-link kind"))?;
        let (session, time_us, echo_us, echo_delay_us) =
            (b.get_u64_le(), b.get_u64_le(), b.get_u64_le(), b.get_u32_le());
        Ok(Datagram { kind, session, time_us, echo_us, echo_delay_us, body: Bytes::copy_from_slice(b) })
    }

    /// An `Open`: a client asks for a new session with these FEC parameters.
    pub fn is_open(&self) -> bool {
        self.kind == Kind::Open
    }
}

/// Where a session is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkState {
    /// A client waiting for `Opened`.
    Opening,
    Open,
    /// Closed, with the reason (by the peer, a silent peer, or a protocol error).
    Closed(String),
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    pub datagrams_sent: u64,
    pub datagrams_received: u64,
    pub data_packets_sent: u64,
    pub repair_packets_sent: u64,
    pub packets_resent: u64,
    pub packets_rebuilt: u64,
    pub nacks_sent: u64,
    pub rto_fired: u64,
    pub refused: u64,
    pub smoothed_rtt_us: u64,
}

/// A body waiting to leave, and what its leaving completes.
struct Out {
    kind: Kind,
    body: Bytes,
    /// Leaving completes this group (its last packet): the group's end in the stream.
    completes: Option<(u64, u64)>,
    resend: bool,
}

struct Unacked {
    /// Stream offset just past the group's bytes.
    end: u64,
    /// When its last packet left (or was last resent), µs; `None` while queued.
    left_at: Option<u64>,
}

/// One side of a far-link session.
pub struct Link<C: ErasureCode> {
    config: LinkConfig,
    session: u64,
    state: LinkState,
    encoder: Encoder<C>,
    decoder: Decoder<C>,
    pacer: Pacer,
    /// Written stream bytes not yet cut into a full payload.
    partial: BytesMut,
    /// A flush asked for the open group's repair packets: they go once the queue is empty.
    close_when_idle: bool,
    /// Stream bytes accepted by `write`, and acknowledged (whole groups), and protected.
    written: u64,
    acked: u64,
    protected: u64,
    /// Stream offset at the end of the payloads pushed into the encoder.
    pushed: u64,
    unacked: BTreeMap<u64, Unacked>,
    resends: VecDeque<Out>,
    queue: VecDeque<Out>,
    /// When the head of the queues may leave (pacing), once computed.
    head_at: Option<u64>,
    received: BytesMut,
    peer_time: Option<(u64, u64)>,
    srtt_us: Option<u64>,
    rttvar_us: u64,
    rto_backoff: u32,
    rto_at: Option<u64>,
    ack_at: Option<u64>,
    last_heard_us: u64,
    last_sent_us: u64,
    last_ack_us: u64,
    open_at: u64,
    pub stats: LinkStats,
}

impl<C: ErasureCode> Link<C> {
    /// A client's side: it sends `Open` until the server answers.
    pub fn client(config: LinkConfig, session: u64, encode: C, decode: C, now_us: u64) -> Link<C> {
        let mut link = Link::new(config, session, encode, decode, now_us, LinkState::Opening);
        link.queue_open();
        link
    }

    /// A server's side of a session a client's `Open` asked for; `None` if the `Open` is not one.
    pub fn server(open: &Datagram, limits: LinkConfig, encode: C, decode: C, now_us: u64) -> Result<Link<C>, FecError> {
        if open.kind != Kind::Open || open.body.len() != 4 {
            return Err(FecError::Malformed("not an Open"));
        }
        let mut b = open.body.clone();
        let config = LinkConfig { r: b.get_u8(), c: b.get_u8(), payload_bytes: b.get_u16_le() as usize, ..limits };
        config.check().map_err(FecError::Overrun)?;
        let mut link = Link::new(config, open.session, encode, decode, now_us, LinkState::Open);
        link.note_peer_time(open, now_us);
        link.queue_control(Kind::Opened, Bytes::new());
        Ok(link)
    }

    fn new(config: LinkConfig, session: u64, encode: C, decode: C, now_us: u64, state: LinkState) -> Link<C> {
        assert!(config.check().is_ok(), "checked config");
        let burst = (config.payload_bytes as u64 + 64) * (config.r as u64 + config.c as u64);
        Link {
            config,
            session,
            state,
            encoder: Encoder::new(encode, config.r, config.c),
            decoder: Decoder::new(decode),
            pacer: Pacer::new(config.rate_bytes_per_s, burst, now_us),
            partial: BytesMut::new(),
            close_when_idle: false,
            written: 0,
            acked: 0,
            protected: 0,
            pushed: 0,
            unacked: BTreeMap::new(),
            resends: VecDeque::new(),
            queue: VecDeque::new(),
            head_at: None,
            received: BytesMut::new(),
            peer_time: None,
            srtt_us: None,
            rttvar_us: 0,
            rto_backoff: 0,
            rto_at: None,
            ack_at: None,
            last_heard_us: now_us,
            last_sent_us: now_us,
            last_ack_us: now_us,
            open_at: now_us,
            stats: LinkStats::default(),
        }
    }

    pub fn session(&self) -> u64 {
        self.session
    }

    pub fn config(&self) -> LinkConfig {
        self.config
    }

    pub fn state(&self) -> &LinkState {
        &self.state
    }

    /// Stream bytes written and not yet acknowledged.
    pub fn in_flight(&self) -> u64 {
        self.written - self.acked
    }

    /// Stream bytes `write` takes now.
    pub fn window_room(&self) -> usize {
        if self.state == LinkState::Open && self.unacked.len() < UNACKED_GROUPS_MAX {
            self.config.window_bytes.saturating_sub(self.in_flight() as usize)
        } else {
            0
        }
    }

    /// Stream bytes that have left with every data and repair packet of their groups.
    pub fn protected(&self) -> u64 {
        self.protected
    }

    /// Stream bytes accepted so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Stream bytes the peer acknowledged (delivered in order at its side).
    pub fn acknowledged(&self) -> u64 {
        self.acked
    }

    /// Everything written has been flushed, sent and acknowledged by the peer.
    pub fn drained(&self) -> bool {
        self.acked == self.written && self.queue.is_empty() && self.resends.iter().all(|o| o.kind != Kind::Fec)
    }

    /// Take up to `window_room()` bytes of the stream; full packets are cut at once, the rest
    /// waits for more or for `flush`.
    pub fn write(&mut self, data: &[u8]) -> Result<usize, FecError> {
        let n = data.len().min(self.window_room());
        let mut rest = &data[..n];
        while !rest.is_empty() {
            let take = (self.config.payload_bytes - self.partial.len()).min(rest.len());
            self.partial.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            self.written += take as u64;
            if self.partial.len() == self.config.payload_bytes {
                let payload = self.partial.split().freeze();
                self.push(payload)?;
            }
        }
        Ok(n)
    }

    /// Send what is written: the partial packet at once, and the open group's repair packets
    /// as soon as nothing else waits to leave. While packets wait for the pacer (the link is
    /// busy) the group stays open for the next writes: groups fill up to r data packets under
    /// load, and close at once when the link is idle (no write waits for later ones).
    pub fn flush(&mut self) -> Result<(), FecError> {
        if !self.partial.is_empty() {
            let payload = self.partial.split().freeze();
            self.push(payload)?;
        }
        if self.encoder.open_payloads() > 0 {
            self.close_when_idle = true;
            if self.queue.is_empty() {
                self.close_group()?;
            }
        }
        Ok(())
    }

    fn close_group(&mut self) -> Result<(), FecError> {
        self.close_when_idle = false;
        let group = self.encoder.next_group();
        if self.encoder.open_payloads() > 0 {
            let packets = self.encoder.close()?;
            self.queue_group_end(group, packets);
        }
        Ok(())
    }

    fn push(&mut self, payload: Bytes) -> Result<(), FecError> {
        let group = self.encoder.next_group();
        self.pushed += payload.len() as u64;
        let mut packets = self.encoder.push(payload)?;
        let closing = self.encoder.next_group() != group;
        let data = packets.remove(0);
        self.queue_fec(data, None, false);
        if closing {
            self.close_when_idle = false;
            self.queue_group_end(group, packets);
        }
        Ok(())
    }

    fn queue_group_end(&mut self, group: u64, packets: Vec<Packet>) {
        self.unacked.insert(group, Unacked { end: self.pushed, left_at: None });
        let last = packets.len().saturating_sub(1);
        for (i, packet) in packets.into_iter().enumerate() {
            let completes = (i == last).then_some((group, self.pushed));
            self.queue_fec(packet, completes, false);
        }
    }

    fn queue_fec(&mut self, packet: Packet, completes: Option<(u64, u64)>, resend: bool) {
        let out = Out { kind: Kind::Fec, body: packet.encode(), completes, resend };
        if resend {
            self.resends.push_back(out);
        } else {
            self.queue.push_back(out);
        }
    }

    fn queue_control(&mut self, kind: Kind, body: Bytes) {
        // Control goes ahead of data, unpaced: it is small and it keeps the peer's timers right.
        self.resends.push_front(Out { kind, body, completes: None, resend: false });
        self.head_at = None;
    }

    fn queue_open(&mut self) {
        let mut body = BytesMut::with_capacity(4);
        body.put_u8(self.config.r);
        body.put_u8(self.config.c);
        body.put_u16_le(self.config.payload_bytes as u16);
        self.queue_control(Kind::Open, body.freeze());
    }

    /// Close the session (the reason goes to the peer, best effort).
    pub fn close(&mut self, reason: &str) {
        if matches!(self.state, LinkState::Closed(_)) {
            return;
        }
        let reason: String = reason.chars().take(200).collect();
        self.queue_control(Kind::Close, Bytes::from(reason.clone().into_bytes()));
        self.state = LinkState::Closed(format!("closed here: {reason}"));
    }

    /// Stream bytes that arrived in order and wait to be read.
    pub fn readable(&self) -> usize {
        self.received.len()
    }

    /// Take up to `max` bytes of the stream that arrived.
    pub fn read(&mut self, max: usize) -> Bytes {
        let n = max.min(self.received.len());
        self.received.split_to(n).freeze()
    }

    fn note_peer_time(&mut self, d: &Datagram, now_us: u64) {
        self.last_heard_us = now_us;
        if self.peer_time.is_none_or(|(t, _)| d.time_us >= t) {
            self.peer_time = Some((d.time_us, now_us));
        }
        if d.echo_us != 0 && d.echo_us <= now_us {
            let sample = (now_us - d.echo_us).saturating_sub(d.echo_delay_us as u64).max(1);
            match self.srtt_us {
                None => {
                    self.srtt_us = Some(sample);
                    self.rttvar_us = sample / 2;
                }
                Some(srtt) => {
                    self.rttvar_us = (3 * self.rttvar_us + srtt.abs_diff(sample)) / 4;
                    self.srtt_us = Some((7 * srtt + sample) / 8);
                }
            }
            self.stats.smoothed_rtt_us = self.srtt_us.unwrap_or(0);
        }
    }

    /// How often a receiver with incomplete groups looks whether to ask for them again, µs.
    fn nack_interval_us(&self) -> u64 {
        (self.srtt_us.unwrap_or(RTT_INITIAL_US) / 2).max(RTO_MIN_US / 4)
    }

    fn rto_us(&self) -> u64 {
        let base = match self.srtt_us {
            Some(srtt) => srtt + 4 * self.rttvar_us.max(1_000),
            None => 3 * RTT_INITIAL_US,
        };
        (base << self.rto_backoff.min(6)).clamp(RTO_MIN_US, RTO_MAX_US)
    }

    /// A datagram of this session arrived (the caller routed it by `session`).
    pub fn receive(&mut self, d: Datagram, now_us: u64) -> Result<(), FecError> {
        if d.session != self.session {
            self.stats.refused += 1;
            return Err(FecError::Malformed("datagram of another session"));
        }
        if matches!(self.state, LinkState::Closed(_)) {
            return Ok(());
        }
        self.stats.datagrams_received += 1;
        self.note_peer_time(&d, now_us);
        match d.kind {
            Kind::Open => {
                // The client did not hear our `Opened` yet.
                if self.state == LinkState::Open && self.written == 0 {
                    self.queue_control(Kind::Opened, Bytes::new());
                }
            }
            Kind::Opened => {
                if self.state == LinkState::Opening {
                    self.state = LinkState::Open;
                }
            }
            Kind::Fec => {
                if self.state == LinkState::Opening {
                    self.state = LinkState::Open;
                }
                let packet = Packet::decode(d.body)?;
                let before = (self.decoder.next_group(), self.decoder.stats.rebuilt);
                if self.received.len() >= RECEIVE_BUFFER_BYTES_MAX && packet.group >= self.decoder.next_group() {
                    return Ok(()); // the reader is behind: this comes again
                }
                for payload in self.decoder.receive(packet)? {
                    self.received.extend_from_slice(&payload);
                }
                self.stats.packets_rebuilt += self.decoder.stats.rebuilt - before.1;
                if self.ack_at.is_none() {
                    self.ack_at = Some(now_us + ACK_DELAY_US);
                }
            }
            Kind::Ack => self.on_ack(d.body, now_us)?,
            Kind::Close => {
                let reason = String::from_utf8_lossy(&d.body).into_owned();
                self.state = LinkState::Closed(format!("closed by the peer: {reason}"));
            }
        }
        Ok(())
    }

    fn on_ack(&mut self, mut body: Bytes, now_us: u64) -> Result<(), FecError> {
        if body.len() < 10 {
            return Err(FecError::Malformed("short acknowledgement"));
        }
        let next_group = body.get_u64_le();
        let count = body.get_u16_le() as usize;
        if count > NACKS_PER_ACK_MAX || body.len() != count * 16 {
            return Err(FecError::Malformed("acknowledgement with a bad request count"));
        }
        if next_group > self.encoder.next_group() {
            return Err(FecError::Malformed("acknowledgement of groups never sent"));
        }
        let mut progressed = false;
        while let Some(entry) = self.unacked.first_entry() {
            if *entry.key() >= next_group {
                break;
            }
            self.acked = entry.remove().end;
            progressed = true;
        }
        self.encoder.acknowledge(next_group);
        if progressed {
            self.rto_backoff = 0;
            self.rto_at = (!self.unacked.is_empty()).then(|| now_us + self.rto_us());
        }
        for _ in 0..count {
            let (group, have) = (body.get_u64_le(), body.get_u64_le());
            if group < next_group || !self.unacked.contains_key(&group) {
                continue;
            }
            self.resend(group, have, now_us)?;
        }
        Ok(())
    }

    fn resend(&mut self, group: u64, have: u64, _now_us: u64) -> Result<(), FecError> {
        let packets = self.encoder.resend(group, have)?;
        let end = self.unacked.get(&group).map(|u| u.end);
        if let Some(u) = self.unacked.get_mut(&group) {
            u.left_at = None;
        }
        let last = packets.len().saturating_sub(1);
        for (i, packet) in packets.into_iter().enumerate() {
            self.stats.packets_resent += 1;
            let completes = end.filter(|_| i == last).map(|end| (group, end));
            self.queue_fec(packet, completes, true);
        }
        Ok(())
    }

    fn head(&self) -> Option<&Out> {
        self.resends.front().or_else(|| self.queue.front())
    }

    /// The next datagram to send now, if any may leave (pacing).
    pub fn poll_transmit(&mut self, now_us: u64) -> Option<Bytes> {
        let head = self.head()?;
        let control = head.kind != Kind::Fec;
        if !control {
            if matches!(self.state, LinkState::Closed(_)) {
                return None;
            }
            let size = (head.body.len() + OVERHEAD_BYTES + 28) as u64;
            let at = *self.head_at.get_or_insert_with(|| self.pacer.send_at(size, now_us));
            if at > now_us {
                return None;
            }
        }
        self.head_at = None;
        let out = self.resends.pop_front().or_else(|| self.queue.pop_front()).expect("a head");
        if self.queue.is_empty() && self.close_when_idle {
            if let Err(e) = self.close_group() {
                self.state = LinkState::Closed(e.to_string());
            }
        }
        if out.kind == Kind::Fec {
            match out.body.first() {
                Some(1) if !out.resend => self.stats.data_packets_sent += 1,
                Some(2) => self.stats.repair_packets_sent += 1,
                _ => {}
            }
        }
        if let Some((group, end)) = out.completes {
            if let Some(u) = self.unacked.get_mut(&group) {
                u.left_at = Some(now_us);
            }
            self.protected = self.protected.max(end);
            if self.rto_at.is_none() {
                self.rto_at = Some(now_us + self.rto_us());
            }
        }
        Some(self.frame(out.kind, &out.body, now_us))
    }

    fn frame(&mut self, kind: Kind, body: &[u8], now_us: u64) -> Bytes {
        let mut d = BytesMut::with_capacity(OVERHEAD_BYTES + body.len());
        d.put_u32_le(MAGIC);
        d.put_u8(kind as u8);
        d.put_u64_le(self.session);
        d.put_u64_le(now_us.max(1));
        let (echo, delay) = match self.peer_time {
            Some((t, at)) => (t, now_us.saturating_sub(at).min(u32::MAX as u64) as u32),
            None => (0, 0),
        };
        d.put_u64_le(echo);
        d.put_u32_le(delay);
        d.put_slice(body);
        let crc = crc32c::crc32c(&d);
        d.put_u32_le(crc);
        self.stats.datagrams_sent += 1;
        self.last_sent_us = now_us;
        d.freeze()
    }

    fn nacks(&mut self, now_us: u64) -> Vec<(u64, u64)> {
        let retry = (self.srtt_us.unwrap_or(RTT_INITIAL_US) * 3 / 2).max(RTO_MIN_US / 2);
        let mut nacks = self.decoder.nacks(now_us, retry);
        nacks.truncate(NACKS_PER_ACK_MAX);
        nacks
    }

    fn send_ack(&mut self, nacks: Vec<(u64, u64)>, now_us: u64) {
        self.stats.nacks_sent += nacks.len() as u64;
        let mut body = BytesMut::with_capacity(10 + 16 * nacks.len());
        body.put_u64_le(self.decoder.next_group());
        body.put_u16_le(nacks.len() as u16);
        for (group, have) in nacks {
            body.put_u64_le(group);
            body.put_u64_le(have);
        }
        self.queue_control(Kind::Ack, body.freeze());
        self.ack_at = None;
        self.last_ack_us = now_us;
    }

    /// When `handle_timeout` wants to run next, µs (a paced packet, an acknowledgement, the
    /// retransmission timer, a keepalive or the silence limit).
    pub fn poll_timeout(&self) -> Option<u64> {
        if let LinkState::Closed(_) = self.state {
            return None;
        }
        let mut t = self.last_heard_us + self.config.idle_timeout_us;
        t = t.min(self.last_sent_us + KEEPALIVE_US);
        for candidate in [self.head_at, self.ack_at, self.rto_at].into_iter().flatten() {
            t = t.min(candidate);
        }
        if self.state == LinkState::Opening {
            t = t.min(self.open_at + OPEN_RETRY_US);
        }
        if self.decoder.pending_groups() > 0 {
            t = t.min(self.last_ack_us + self.nack_interval_us());
        }
        Some(t)
    }

    pub fn handle_timeout(&mut self, now_us: u64) -> Result<(), FecError> {
        if let LinkState::Closed(_) = self.state {
            return Ok(());
        }
        if now_us >= self.last_heard_us + self.config.idle_timeout_us {
            self.state =
                LinkState::Closed(format!("the peer was silent for {} s", self.config.idle_timeout_us / 1_000_000));
            return Ok(());
        }
        if self.state == LinkState::Opening && now_us >= self.open_at + OPEN_RETRY_US {
            self.open_at = now_us;
            self.queue_open();
        }
        if self.rto_at.is_some_and(|at| now_us >= at) {
            self.rto_at = None;
            let rto = self.rto_us();
            let due: Vec<u64> = self
                .unacked
                .iter()
                .filter(|(_, u)| u.left_at.is_some_and(|at| now_us >= at + rto))
                .map(|(g, _)| *g)
                .take(RTO_GROUPS_MAX)
                .collect();
            if !due.is_empty() {
                self.stats.rto_fired += 1;
                self.rto_backoff += 1;
                for group in due {
                    self.resend(group, 0, now_us)?;
                }
            }
            if !self.unacked.is_empty() {
                self.rto_at = Some(now_us + self.rto_us());
            }
        }
        let nack_due = self.decoder.pending_groups() > 0 && now_us >= self.last_ack_us + self.nack_interval_us();
        let nacks = if nack_due || self.ack_at.is_some() { self.nacks(now_us) } else { Vec::new() };
        if self.ack_at.is_some_and(|at| now_us >= at) || now_us >= self.last_sent_us + KEEPALIVE_US || !nacks.is_empty()
        {
            self.send_ack(nacks, now_us);
        } else if nack_due {
            // Nothing to ask for yet: look again after the interval.
            self.last_ack_us = now_us;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
