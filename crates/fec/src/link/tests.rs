//! Two link ends over a simulated path: one-way delay, jitter (reordering), random loss, a
//! cut, and a time that only moves when something is due.

use std::collections::BTreeMap;

use bytes::Bytes;

use super::*;
use crate::GaloisCode;

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn chance(&mut self, p: f64) -> bool {
        (self.next() % 1_000_000) as f64 / 1_000_000.0 < p
    }
}

/// Decides to drop a datagram: (its index among all sent, the side it leaves, its bytes).
type DropRule = Box<dyn FnMut(u64, usize, &[u8]) -> bool>;

struct Path {
    delay_us: u64,
    jitter_us: u64,
    loss: f64,
    /// Drop what would leave a side while this returns true (datagram index, side).
    drop: DropRule,
}

impl Path {
    fn new(delay_us: u64, loss: f64) -> Path {
        Path { delay_us, jitter_us: 0, loss, drop: Box::new(|_, _, _| false) }
    }
}

struct World {
    now: u64,
    ends: [Link<GaloisCode>; 2],
    /// Arrival time (and a tiebreak) → (to side, datagram).
    flight: BTreeMap<(u64, u64), (usize, Bytes)>,
    sent: u64,
    rng: Rng,
    path: Path,
    got: [Vec<u8>; 2],
}

fn config(rate_bytes_per_s: u64) -> LinkConfig {
    LinkConfig { rate_bytes_per_s, ..LinkConfig::default() }
}

impl World {
    fn new(config: LinkConfig, path: Path, seed: u64) -> World {
        let mut client = Link::client(config, 42, GaloisCode::default(), GaloisCode::default(), 0);
        let open = Datagram::parse(&client.poll_transmit(0).expect("an Open")).expect("parses");
        assert!(open.is_open());
        let server = Link::server(&open, config, GaloisCode::default(), GaloisCode::default(), path.delay_us)
            .expect("a server side");
        let mut w = World {
            now: path.delay_us,
            ends: [client, server],
            flight: BTreeMap::new(),
            sent: 0,
            rng: Rng(seed | 1),
            path,
            got: [Vec::new(), Vec::new()],
        };
        w.transmit();
        while *w.ends[0].state() == LinkState::Opening && w.step(u64::MAX) {}
        w
    }

    fn transmit(&mut self) {
        for side in 0..2 {
            while let Some(d) = self.ends[side].poll_transmit(self.now) {
                self.sent += 1;
                if self.rng.chance(self.path.loss) || (self.path.drop)(self.sent, side, &d) {
                    continue;
                }
                let jitter = if self.path.jitter_us > 0 { self.rng.next() % self.path.jitter_us } else { 0 };
                self.flight.insert((self.now + self.path.delay_us + jitter, self.sent), (1 - side, d));
            }
        }
    }

    /// Advance to the next event and handle it. False when nothing is left to happen before
    /// `until`.
    fn step(&mut self, until: u64) -> bool {
        let next_arrival = self.flight.keys().next().map(|k| k.0);
        let next_timer = self.ends.iter().filter_map(|e| e.poll_timeout()).min();
        let Some(t) = [next_arrival, next_timer].into_iter().flatten().min() else { return false };
        if t > until {
            return false;
        }
        self.now = self.now.max(t);
        while let Some(entry) = self.flight.first_entry() {
            if entry.key().0 > self.now {
                break;
            }
            let (to, d) = entry.remove();
            let d = Datagram::parse(&d).expect("our datagrams parse");
            self.ends[to].receive(d, self.now).expect("receive");
        }
        for side in 0..2 {
            if self.ends[side].poll_timeout().is_some_and(|t| t <= self.now) {
                self.ends[side].handle_timeout(self.now).expect("timeout");
            }
            let n = self.ends[side].readable();
            let bytes = self.ends[side].read(n);
            self.got[side].extend_from_slice(&bytes);
        }
        self.transmit();
        true
    }

    /// Write all of `data` from `side` (waiting for window room), flushing after each write of
    /// `chunk` bytes, and run until the other side has it all or `until`.
    fn send(&mut self, side: usize, data: &[u8], chunk: usize, until: u64) {
        let mut at = 0;
        while at < data.len() && self.now < until {
            let end = (at + chunk).min(data.len());
            let n = self.ends[side].write(&data[at..end]).expect("write");
            at += n;
            if n > 0 {
                self.ends[side].flush().expect("flush");
                self.transmit();
            }
            if n == 0 || at == data.len() {
                self.step(until);
            }
        }
        while self.got[1 - side].len() < data.len() && self.step(until) {}
    }
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
}

#[test]
fn without_loss_the_stream_arrives_in_order_and_is_protected_on_the_wire() {
    let mut w = World::new(config(0), Path::new(25_000, 0.0), 1);
    let data = pattern(1 << 20);
    w.send(0, &data, 4096, 10_000_000);
    assert!(w.got[1] == data, "{} of {} bytes", w.got[1].len(), data.len());
    assert_eq!(w.ends[0].protected(), data.len() as u64, "every group's repair packets left");
    assert_eq!(w.ends[1].stats.packets_rebuilt, 0);
    assert_eq!(w.ends[0].stats.packets_resent, 0);
    // And back the other way, on the same session.
    let reply = pattern(10_000);
    w.send(1, &reply, 300, w.now + 10_000_000);
    assert!(w.got[0] == reply, "{} of {} bytes", w.got[0].len(), reply.len());
}

#[test]
fn random_loss_is_repaired_by_fec_and_what_it_cannot_repair_is_sent_again() {
    for (loss, seed) in [(0.01, 3), (0.05, 5), (0.2, 7)] {
        let mut w = World::new(config(12_500_000), Path::new(25_000, loss), seed);
        let data = pattern(2 << 20);
        w.send(0, &data, 4096, 60_000_000);
        assert!(w.got[1] == data, "loss {loss}: {} of {} bytes in order", w.got[1].len(), data.len());
        assert!(w.ends[1].stats.packets_rebuilt > 0, "loss {loss}: FEC rebuilt packets");
        if loss >= 0.2 {
            assert!(w.ends[0].stats.packets_resent > 0, "loss {loss}: some groups lost more than c");
        }
    }
}

#[test]
fn a_lost_tail_is_sent_again_by_the_timer() {
    // The client's datagrams 4 to 39 are lost: the one group of the write and all its repairs
    // vanish, and no later group shows the receiver a gap.
    let mut path = Path::new(10_000, 0.0);
    path.drop = Box::new(move |n, side, _| side == 0 && n > 3 && n < 40);
    let mut w = World::new(config(0), path, 9);
    let data = pattern(20_000);
    w.send(0, &data, 20_000, 5_000_000);
    assert!(w.got[1] == data, "{} of {} bytes", w.got[1].len(), data.len());
    assert!(w.ends[0].stats.rto_fired >= 1);
}

#[test]
fn jitter_reorders_packets_and_the_stream_is_still_in_order() {
    let mut path = Path::new(20_000, 0.02);
    path.jitter_us = 8_000;
    let mut w = World::new(config(0), path, 11);
    let data = pattern(1 << 20);
    w.send(0, &data, 4096, 30_000_000);
    assert!(w.got[1] == data);
}

#[test]
fn pacing_holds_the_rate_with_the_repair_overhead() {
    // 10 MB/s, 4 MiB in full groups: 4 MiB × 11/8 of datagrams (plus headers) at 10 MB/s.
    let mut w = World::new(config(10_000_000), Path::new(1_000, 0.0), 13);
    let data = pattern(4 << 20);
    let start = w.now;
    w.send(0, &data, 64 << 10, 60_000_000);
    assert!(w.got[1] == data);
    let took = (w.now - start) as f64 / 1e6;
    let payload = w.ends[0].config().payload_bytes as f64;
    let wire = data.len() as f64 * 11.0 / 8.0 * (payload + 80.0) / payload;
    let expected = wire / 10_000_000.0;
    assert!((took - expected).abs() / expected < 0.05, "took {took:.3} s, the rate says {expected:.3} s");
}

#[test]
fn the_window_bounds_what_is_in_flight() {
    let config = LinkConfig { window_bytes: 64 << 10, ..config(0) };
    let mut w = World::new(config, Path::new(50_000, 0.0), 15);
    let data = pattern(1 << 20);
    let n = w.ends[0].write(&data).expect("write");
    assert_eq!(n, 64 << 10, "a write takes what the window has room for");
    assert_eq!(w.ends[0].write(&data[n..]).expect("write"), 0);
    w.ends[0].flush().expect("flush");
    w.transmit();
    while w.ends[0].acknowledged() < n as u64 && w.step(1_000_000) {}
    assert_eq!(w.ends[0].in_flight(), 0);
    assert_eq!(w.ends[0].window_room(), 64 << 10, "acknowledged bytes free the window");
}

#[test]
fn fec_without_repair_packets_still_delivers_by_resending() {
    let config = LinkConfig { c: 0, ..config(0) };
    let mut w = World::new(config, Path::new(10_000, 0.02), 17);
    let data = pattern(256 << 10);
    w.send(0, &data, 4096, 30_000_000);
    assert!(w.got[1] == data);
    assert_eq!(w.ends[1].stats.packets_rebuilt, 0);
    assert!(w.ends[0].stats.packets_resent > 0);
}

#[test]
fn a_silent_peer_closes_the_session_and_a_close_is_heard() {
    let mut path = Path::new(5_000, 0.0);
    path.drop = Box::new(|n, _, _| n > 20);
    let mut w = World::new(config(0), path, 19);
    w.send(0, &pattern(1000), 1000, 1_000_000);
    while w.step(30_000_000) {}
    for end in &w.ends {
        assert!(matches!(end.state(), LinkState::Closed(why) if why.contains("silent")), "{:?}", end.state());
    }
    let mut w = World::new(config(0), Path::new(5_000, 0.0), 21);
    w.ends[0].close("host element stopping");
    w.transmit();
    while w.step(1_000_000) {}
    assert!(matches!(w.ends[1].state(), LinkState::Closed(why) if why.contains("host element stopping")));
}

#[test]
fn strangers_and_damaged_datagrams_are_refused() {
    for junk in [&b""[..], b"GET / HTTP/1.1\r\n\r\n", &[0u8; 64]] {
        assert!(Datagram::parse(junk).is_err());
    }
    let mut client = Link::client(config(0), 7, GaloisCode::default(), GaloisCode::default(), 0);
    let open = client.poll_transmit(0).expect("open");
    let mut damaged = open.to_vec();
    damaged[20] ^= 1;
    assert!(Datagram::parse(&damaged).is_err(), "a flipped bit fails the checksum");
    let open = Datagram::parse(&open).expect("parses");
    let bad_limits = LinkConfig { r: 0, ..config(0) };
    assert!(bad_limits.check().is_err());
    let mut server = Link::server(&open, config(0), GaloisCode::default(), GaloisCode::default(), 0).expect("server");
    let mut other = Link::client(config(0), 8, GaloisCode::default(), GaloisCode::default(), 0);
    let foreign = Datagram::parse(&other.poll_transmit(0).expect("open")).expect("parses");
    assert!(server.receive(foreign, 1).is_err(), "a datagram of another session is refused");
    assert_eq!(server.state(), &LinkState::Open);
}

#[test]
fn groups_fill_under_load_and_close_at_once_when_idle() {
    // Paced at 1 MB/s, 200 writes of 1 000 bytes each flushed: the link is busy, so groups
    // fill to r data packets instead of closing at every flush.
    let mut w = World::new(config(1_000_000), Path::new(5_000, 0.0), 23);
    let data = pattern(200_000);
    w.send(0, &data, 1000, 10_000_000);
    assert!(w.got[1] == data);
    let s = w.ends[0].stats;
    // Closing at every flush would send 3 repair packets per data packet; full groups 3/8.
    assert!(
        s.repair_packets_sent * 2 <= s.data_packets_sent,
        "groups fill under load: {} repair packets for {} data packets",
        s.repair_packets_sent,
        s.data_packets_sent
    );
    // Idle: one small write is protected (its repair packets left) without waiting for more.
    let before = w.ends[0].protected();
    w.ends[0].write(b"one more").expect("write");
    w.ends[0].flush().expect("flush");
    w.transmit();
    assert_eq!(w.ends[0].protected(), before + 8, "its group closed at once");
}
