//! The path model of one direction of a link, without I/O: given a packet's arrival time and
//! length it decides whether the packet is dropped (cut, full queue, random or bursty loss) or
//! when it leaves the far end. Time (nanoseconds since the link started) and the random source
//! are passed in, so the model is exact and repeatable under test.
//!
//! The bottleneck is a FIFO serialiser: a packet starts when the previous one has finished
//! (`line_free_at_ns`), occupies the line for `len * 8 / rate`, and arrives one delay after
//! its last bit left. Loss happens on the wire, after the packet has used its share of the rate.

use rand::Rng;
use serde::Serialize;

use crate::limits::PACKETS_IN_FLIGHT_MAX;
use crate::params::LinkParams;

/// What happens to a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Hand it to the far end at this time.
    Deliver {
        at_ns: u64,
    },
    Drop(DropReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// The link is cut (at arrival or while the packet was on the wire).
    Cut,
    /// The bottleneck queue is full, or too many packets are in flight.
    Queue,
    /// Independent random loss.
    Loss,
    /// The Gilbert chain is in its bad state.
    Burst,
}

/// Counters of one direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PathStats {
    pub packets_in: u64,
    pub bytes_in: u64,
    pub packets_delivered: u64,
    pub bytes_delivered: u64,
    pub dropped_cut: u64,
    pub dropped_queue: u64,
    pub dropped_loss: u64,
    pub dropped_burst: u64,
    /// Scheduled but never delivered because their connection (proxy) or relay ended first.
    pub abandoned: u64,
    /// Sum and maximum, over delivered packets, of how late the shell handed them over: the
    /// emulator's own timing error (the OS timer, scheduling).
    pub late_ns_total: u64,
    pub late_ns_max: u64,
}

impl PathStats {
    pub fn dropped(&self) -> u64 {
        self.dropped_cut + self.dropped_queue + self.dropped_loss + self.dropped_burst + self.abandoned
    }
}

impl std::fmt::Display for PathStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} packets delivered ({} bytes); dropped: {} cut, {} queue, {} loss, {} burst, {} abandoned",
            self.packets_delivered,
            self.packets_in,
            self.bytes_delivered,
            self.dropped_cut,
            self.dropped_queue,
            self.dropped_loss,
            self.dropped_burst,
            self.abandoned
        )
    }
}

/// One direction of a link.
#[derive(Debug, Clone)]
pub struct PathModel {
    params: LinkParams,
    cut: bool,
    /// No packet enters, but those on the wire arrive: the sending site is gone (a disaster),
    /// the network is not.
    closed: bool,
    /// The Gilbert chain's state.
    burst_bad: bool,
    /// When the serialiser finishes the last accepted packet.
    line_free_at_ns: u64,
    /// The latest delivery time handed out; deliveries never overtake each other, also when
    /// the delay is lowered at run time.
    delivery_last_ns: u64,
    packets_in_flight: u64,
    stats: PathStats,
}

impl PathModel {
    pub fn new(params: LinkParams) -> PathModel {
        params.validate().expect("parameters are validated before they reach the model");
        PathModel {
            params,
            cut: false,
            closed: false,
            burst_bad: false,
            line_free_at_ns: 0,
            delivery_last_ns: 0,
            packets_in_flight: 0,
            stats: PathStats::default(),
        }
    }

    pub fn params(&self) -> LinkParams {
        self.params
    }

    pub fn set_params(&mut self, params: LinkParams) {
        params.validate().expect("parameters are validated before they reach the model");
        self.params = params;
    }

    pub fn cut(&mut self) {
        self.cut = true;
    }

    pub fn heal(&mut self) {
        self.cut = false;
        self.closed = false;
    }

    /// Refuse every packet from now on, and deliver those already on the wire (as when the
    /// site at the link's entry is destroyed). Undone by [`PathModel::heal`].
    pub fn close_entry(&mut self) {
        self.closed = true;
    }

    pub fn is_cut(&self) -> bool {
        self.cut
    }

    pub fn stats(&self) -> PathStats {
        self.stats
    }

    /// A packet of `len_bytes` entered the link at `now_ns`.
    pub fn handle_packet(&mut self, now_ns: u64, len_bytes: u64, rng: &mut impl Rng) -> Verdict {
        self.stats.packets_in += 1;
        self.stats.bytes_in += len_bytes;
        let verdict = self.decide(now_ns, len_bytes, rng);
        match verdict {
            Verdict::Deliver { .. } => self.packets_in_flight += 1,
            Verdict::Drop(reason) => self.count_drop(reason),
        }
        self.assert_invariants();
        verdict
    }

    fn decide(&mut self, now_ns: u64, len_bytes: u64, rng: &mut impl Rng) -> Verdict {
        if self.cut || self.closed {
            return Verdict::Drop(DropReason::Cut);
        }
        if self.packets_in_flight >= PACKETS_IN_FLIGHT_MAX {
            return Verdict::Drop(DropReason::Queue);
        }
        if self.params.rate_mbit.is_some() && self.backlog_ns(now_ns) > self.params.queue_ns_max() {
            return Verdict::Drop(DropReason::Queue);
        }
        let start_ns = self.line_free_at_ns.max(now_ns);
        self.line_free_at_ns = start_ns + self.params.serialisation_ns(len_bytes);
        // Step the chain for every packet that reaches the wire, whatever the outcome.
        if let Some(burst) = self.params.burst_loss {
            let p_flip = if self.burst_bad { burst.p_exit } else { burst.p_enter };
            if rng.gen::<f64>() < p_flip {
                self.burst_bad = !self.burst_bad;
            }
        } else {
            self.burst_bad = false;
        }
        if self.burst_bad {
            return Verdict::Drop(DropReason::Burst);
        }
        if self.params.loss_percent > 0.0 && rng.gen::<f64>() * 100.0 < self.params.loss_percent {
            return Verdict::Drop(DropReason::Loss);
        }
        let at_ns = (self.line_free_at_ns + self.params.delay_ns()).max(self.delivery_last_ns);
        self.delivery_last_ns = at_ns;
        Verdict::Deliver { at_ns }
    }

    /// Schedules `len_bytes` of a byte stream (the TCP proxy) that entered at `now_ns`: the
    /// serialiser and the delay as for a packet, but never a drop, since a stream cannot lose
    /// bytes; the caller keeps the backlog short instead (see [`PathModel::backlog_ns`]).
    /// Returns the delivery time; hand the bytes to [`PathModel::handle_due`] then.
    pub fn handle_bytes(&mut self, now_ns: u64, len_bytes: u64) -> u64 {
        assert!(self.params.loss_percent == 0.0 && self.params.burst_loss.is_none(), "a byte stream has no loss");
        self.stats.packets_in += 1;
        self.stats.bytes_in += len_bytes;
        let start_ns = self.line_free_at_ns.max(now_ns);
        self.line_free_at_ns = start_ns + self.params.serialisation_ns(len_bytes);
        let at_ns = (self.line_free_at_ns + self.params.delay_ns()).max(self.delivery_last_ns);
        self.delivery_last_ns = at_ns;
        self.packets_in_flight += 1;
        self.assert_invariants();
        at_ns
    }

    /// How long a packet arriving at `now_ns` would wait for the serialiser.
    pub fn backlog_ns(&self, now_ns: u64) -> u64 {
        self.line_free_at_ns.saturating_sub(now_ns)
    }

    /// A packet that [`Verdict::Deliver`] scheduled for `at_ns` is due at `now_ns`; returns
    /// whether to hand it over (a cut while it was on the wire loses it).
    pub fn handle_due(&mut self, now_ns: u64, at_ns: u64, len_bytes: u64) -> bool {
        assert!(self.packets_in_flight > 0, "a packet is due that was never scheduled");
        assert!(now_ns >= at_ns, "a packet is handed over before it is due");
        self.packets_in_flight -= 1;
        let delivered = !self.cut;
        if delivered {
            self.stats.packets_delivered += 1;
            self.stats.bytes_delivered += len_bytes;
            self.stats.late_ns_total += now_ns - at_ns;
            self.stats.late_ns_max = self.stats.late_ns_max.max(now_ns - at_ns);
        } else {
            self.stats.dropped_cut += 1;
        }
        self.assert_invariants();
        delivered
    }

    /// Forgets packets scheduled but never handed to [`PathModel::handle_due`] (the relay
    /// stopped).
    pub fn handle_abandoned(&mut self, packets: u64) {
        assert!(packets <= self.packets_in_flight);
        self.packets_in_flight -= packets;
        self.stats.abandoned += packets;
        self.assert_invariants();
    }

    fn count_drop(&mut self, reason: DropReason) {
        let counter = match reason {
            DropReason::Cut => &mut self.stats.dropped_cut,
            DropReason::Queue => &mut self.stats.dropped_queue,
            DropReason::Loss => &mut self.stats.dropped_loss,
            DropReason::Burst => &mut self.stats.dropped_burst,
        };
        *counter += 1;
    }

    pub fn assert_invariants(&self) {
        let s = &self.stats;
        assert_eq!(
            s.packets_in,
            s.packets_delivered + s.dropped() + self.packets_in_flight,
            "every packet is delivered, dropped or in flight"
        );
        assert!(s.bytes_delivered <= s.bytes_in);
        if self.params.burst_loss.is_none() {
            assert!(!self.burst_bad, "no bad state without burst loss");
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::*;
    use crate::params::BurstLoss;

    const MS: u64 = 1_000_000;

    /// Feeds packets as (arrival ns, length) and compares each verdict with the table.
    fn check(params: LinkParams, table: &[(u64, u64, Verdict)]) {
        let mut model = PathModel::new(params);
        let mut rng = StdRng::seed_from_u64(1);
        for (i, &(now_ns, len, expected)) in table.iter().enumerate() {
            let got = model.handle_packet(now_ns, len, &mut rng);
            assert_eq!(got, expected, "row {i}: packet of {len} bytes at {now_ns} ns");
        }
    }

    fn at(at_ns: u64) -> Verdict {
        Verdict::Deliver { at_ns }
    }

    #[test]
    fn packets_of_an_ended_connection_are_counted_and_the_path_goes_on() {
        // Regression: abandoned packets were forgotten without being counted, so the next
        // packet broke the accounting invariant (a panic in the proxy after a kill -9).
        let mut model = PathModel::new(LinkParams { delay_ms_one_way: 8.0, ..LinkParams::default() });
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..3 {
            assert!(matches!(model.handle_packet(0, 1500, &mut rng), Verdict::Deliver { .. }));
        }
        model.handle_abandoned(3);
        assert_eq!(model.stats().abandoned, 3);
        assert!(matches!(model.handle_packet(MS, 1500, &mut rng), Verdict::Deliver { .. }));
        assert!(model.handle_due(9 * MS, 9 * MS, 1500));
        model.assert_invariants();
    }

    #[test]
    fn delay_only() {
        let params = LinkParams { delay_ms_one_way: 8.0, ..LinkParams::default() };
        check(
            params,
            &[
                //  arrival   len   verdict
                (0, 1500, at(8 * MS)),
                (0, 1500, at(8 * MS)),
                (3 * MS, 40, at(11 * MS)),
            ],
        );
    }

    #[test]
    fn rate_serialises_and_queue_drops_tail() {
        // 12 Mbit/s: a 1500-byte packet takes 1 ms; the queue holds 2 ms.
        let params =
            LinkParams { delay_ms_one_way: 5.0, rate_mbit: Some(12.0), queue_ms_max: 2.0, ..LinkParams::default() };
        check(
            params,
            &[
                //  arrival   len   verdict
                (0, 1500, at(6 * MS)), // line free: 1 ms to serialise
                (0, 1500, at(7 * MS)), // waits 1 ms
                (0, 1500, at(8 * MS)), // waits 2 ms: the queue is full now
                (0, 1500, Verdict::Drop(DropReason::Queue)),
                (MS, 1500, at(9 * MS)), // 1 ms later the queue has room again
                (20 * MS, 750, at(20 * MS + MS / 2 + 5 * MS)),
            ],
        );
    }

    #[test]
    fn lowering_the_delay_keeps_order() {
        let mut model = PathModel::new(LinkParams { delay_ms_one_way: 30.0, ..LinkParams::default() });
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(model.handle_packet(0, 100, &mut rng), at(30 * MS));
        model.set_params(LinkParams { delay_ms_one_way: 1.0, ..LinkParams::default() });
        assert_eq!(model.handle_packet(MS, 100, &mut rng), at(30 * MS), "not before the earlier packet");
        assert_eq!(model.handle_packet(40 * MS, 100, &mut rng), at(41 * MS));
    }

    #[test]
    fn a_closed_entry_drops_arrivals_and_delivers_what_is_on_the_wire() {
        let mut model = PathModel::new(LinkParams { delay_ms_one_way: 10.0, ..LinkParams::default() });
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(model.handle_packet(0, 100, &mut rng), at(10 * MS));
        model.close_entry();
        assert_eq!(model.handle_packet(MS, 100, &mut rng), Verdict::Drop(DropReason::Cut));
        assert!(model.handle_due(10 * MS, 10 * MS, 100), "on the wire when the entry closed: delivered");
        model.heal();
        assert_eq!(model.handle_packet(11 * MS, 100, &mut rng), at(21 * MS));
    }

    #[test]
    fn cut_drops_arrivals_and_packets_on_the_wire() {
        let mut model = PathModel::new(LinkParams { delay_ms_one_way: 10.0, ..LinkParams::default() });
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(model.handle_packet(0, 100, &mut rng), at(10 * MS));
        model.cut();
        assert_eq!(model.handle_packet(MS, 100, &mut rng), Verdict::Drop(DropReason::Cut));
        assert!(!model.handle_due(10 * MS, 10 * MS, 100), "on the wire when the link was cut");
        model.heal();
        assert_eq!(model.handle_packet(20 * MS, 100, &mut rng), at(30 * MS));
        assert!(model.handle_due(31 * MS, 30 * MS, 100));
        let s = model.stats();
        assert_eq!((s.packets_in, s.packets_delivered, s.dropped_cut, s.late_ns_max), (3, 1, 2, MS));
    }

    /// Runs `packets` back-to-back packets and returns (loss fraction, mean burst length).
    fn loss_of(params: LinkParams, packets: u64) -> (f64, f64) {
        let mut model = PathModel::new(params);
        let mut rng = StdRng::seed_from_u64(7);
        let (mut lost, mut bursts, mut previous_lost) = (0u64, 0u64, false);
        for i in 0..packets {
            let verdict = model.handle_packet(i, 100, &mut rng);
            let is_lost = matches!(verdict, Verdict::Drop(_));
            if let Verdict::Deliver { at_ns } = verdict {
                assert!(model.handle_due(at_ns, at_ns, 100));
            }
            lost += u64::from(is_lost);
            bursts += u64::from(is_lost && !previous_lost);
            previous_lost = is_lost;
        }
        (lost as f64 / packets as f64, lost as f64 / bursts.max(1) as f64)
    }

    #[test]
    #[rustfmt::skip]
    fn loss_rates_converge() {
        let base = LinkParams::default();
        let burst = |p_enter, p_exit| Some(BurstLoss { p_enter, p_exit });
        // (params, expected loss fraction, expected mean run of lost packets)
        let table = [
            (LinkParams { loss_percent: 1.0, ..base },                 0.01,   1.0),
            (LinkParams { loss_percent: 10.0, ..base },                0.10,   1.11),
            (LinkParams { burst_loss: burst(0.01, 0.25), ..base },     0.0385, 4.0),
            (LinkParams { burst_loss: burst(0.001, 0.5), ..base },     0.002,  2.0),
        ];
        for (params, loss, burst) in table {
            let (got_loss, got_burst) = loss_of(params, 400_000);
            assert!((got_loss - loss).abs() < loss * 0.1, "{params}: loss {got_loss} vs {loss}");
            assert!((got_burst - burst).abs() < burst * 0.1, "{params}: burst {got_burst} vs {burst}");
        }
    }
}
