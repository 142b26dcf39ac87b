//! What a link does to traffic: one-way delay, rate, random and bursty loss, queue size. The
//! same parameters hold in both directions and can be changed while the link carries traffic.

use serde::{Deserialize, Serialize};

use crate::limits::{DELAY_MS_MAX, QUEUE_MS_DEFAULT, RATE_MBIT_MIN};

/// The Gilbert model of bursty loss: a two-state Markov chain stepped once per packet. In the
/// good state packets are lost only at [`LinkParams::loss_percent`]; in the bad state every
/// packet is lost. The mean loss from bursts is `p_enter / (p_enter + p_exit)` and the mean
/// burst length `1 / p_exit` packets.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BurstLoss {
    /// Probability, per packet in the good state, of entering the bad state (0..=1).
    pub p_enter: f64,
    /// Probability, per packet in the bad state, of leaving it (0 < p_exit <= 1).
    pub p_exit: f64,
}

impl BurstLoss {
    /// The long-run fraction of packets sent in the bad state (all of them lost).
    pub fn mean_loss(&self) -> f64 {
        self.p_enter / (self.p_enter + self.p_exit)
    }
}

/// Parameters of one emulated link, applied to each direction independently.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkParams {
    /// Time every packet (or, in proxy mode, every byte) spends on the path, in milliseconds.
    pub delay_ms_one_way: f64,
    /// Bottleneck rate in Mbit/s (10⁶ bit/s) counted on whole IP packets; `None`: unlimited.
    pub rate_mbit: Option<f64>,
    /// Independent random loss, percent of packets (0..100).
    pub loss_percent: f64,
    /// Bursty loss on top of `loss_percent`.
    pub burst_loss: Option<BurstLoss>,
    /// The bottleneck queue, as the time it takes to drain at `rate_mbit`; a packet that would
    /// wait longer is dropped (tail drop). Ignored without a rate, and by the proxy, which
    /// reads no more than 2 ms ahead of its serialiser.
    pub queue_ms_max: f64,
}

impl Default for LinkParams {
    fn default() -> Self {
        LinkParams {
            delay_ms_one_way: 0.0,
            rate_mbit: None,
            loss_percent: 0.0,
            burst_loss: None,
            queue_ms_max: QUEUE_MS_DEFAULT,
        }
    }
}

/// A parameter out of its range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParamsError {
    #[error("delay {0} ms is outside 0..={DELAY_MS_MAX} ms")]
    Delay(f64),
    #[error("rate {0} Mbit/s is below {RATE_MBIT_MIN} Mbit/s or not a number")]
    Rate(f64),
    #[error("loss {0} % is outside 0..100 %")]
    Loss(f64),
    #[error("burst loss p_enter {0} must be in 0..=1 and p_exit {1} in (0, 1]")]
    BurstLoss(f64, f64),
    #[error("queue {0} ms is outside 0..={DELAY_MS_MAX} ms")]
    Queue(f64),
    #[error("the TCP proxy cannot lose packets: it carries a byte stream; use the namespace mode for loss")]
    LossInProxy,
}

impl LinkParams {
    /// Checks every field's range.
    pub fn validate(&self) -> Result<(), ParamsError> {
        let in_range = |v: f64, max: f64| v.is_finite() && (0.0..=max).contains(&v);
        if !in_range(self.delay_ms_one_way, DELAY_MS_MAX) {
            return Err(ParamsError::Delay(self.delay_ms_one_way));
        }
        if let Some(rate) = self.rate_mbit {
            if !rate.is_finite() || rate < RATE_MBIT_MIN {
                return Err(ParamsError::Rate(rate));
            }
        }
        if !in_range(self.loss_percent, 100.0) || self.loss_percent >= 100.0 {
            return Err(ParamsError::Loss(self.loss_percent));
        }
        if let Some(b) = self.burst_loss {
            let ok = in_range(b.p_enter, 1.0) && b.p_exit.is_finite() && b.p_exit > 0.0 && b.p_exit <= 1.0;
            if !ok {
                return Err(ParamsError::BurstLoss(b.p_enter, b.p_exit));
            }
        }
        if !in_range(self.queue_ms_max, DELAY_MS_MAX) {
            return Err(ParamsError::Queue(self.queue_ms_max));
        }
        Ok(())
    }

    /// Checks the parameters for the TCP proxy, which can delay and pace bytes but not lose them.
    pub fn validate_for_proxy(&self) -> Result<(), ParamsError> {
        self.validate()?;
        if self.loss_percent > 0.0 || self.burst_loss.is_some() {
            return Err(ParamsError::LossInProxy);
        }
        Ok(())
    }

    /// The one-way delay in nanoseconds.
    pub fn delay_ns(&self) -> u64 {
        (self.delay_ms_one_way * 1e6).round() as u64
    }

    /// Nanoseconds to serialise `len_bytes` at the rate; 0 without a rate.
    pub fn serialisation_ns(&self, len_bytes: u64) -> u64 {
        match self.rate_mbit {
            // Mbit/s = bit/µs, so bits / rate is in µs.
            Some(rate) => ((len_bytes * 8) as f64 * 1e3 / rate).round() as u64,
            None => 0,
        }
    }

    /// The longest wait in the bottleneck queue, in nanoseconds.
    pub fn queue_ns_max(&self) -> u64 {
        (self.queue_ms_max * 1e6).round() as u64
    }
}

impl std::fmt::Display for LinkParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "delay {} ms one-way", self.delay_ms_one_way)?;
        match self.rate_mbit {
            Some(rate) => write!(f, ", rate {rate} Mbit/s (queue {} ms)", self.queue_ms_max)?,
            None => write!(f, ", rate unlimited")?,
        }
        write!(f, ", loss {} %", self.loss_percent)?;
        if let Some(b) = self.burst_loss {
            write!(f, ", burst loss p_enter {} p_exit {} (mean {:.3} %)", b.p_enter, b.p_exit, 100.0 * b.mean_loss())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(params: LinkParams, expected: Result<(), ParamsError>) {
        assert_eq!(params.validate(), expected, "{params:?}");
    }

    #[test]
    #[rustfmt::skip]
    fn ranges() {
        let ok = LinkParams::default();
        let burst = |p_enter, p_exit| Some(BurstLoss { p_enter, p_exit });
        check(ok, Ok(()));
        check(LinkParams { delay_ms_one_way: -1.0, ..ok },   Err(ParamsError::Delay(-1.0)));
        check(LinkParams { rate_mbit: Some(0.0), ..ok },     Err(ParamsError::Rate(0.0)));
        check(LinkParams { loss_percent: 100.0, ..ok },      Err(ParamsError::Loss(100.0)));
        check(LinkParams { burst_loss: burst(0.1, 0.0), ..ok }, Err(ParamsError::BurstLoss(0.1, 0.0)));
        check(LinkParams { burst_loss: burst(1.5, 0.5), ..ok }, Err(ParamsError::BurstLoss(1.5, 0.5)));
        check(LinkParams { queue_ms_max: -5.0, ..ok },       Err(ParamsError::Queue(-5.0)));
        // NaN never equals itself, so compare the variant only.
        let nan = LinkParams { delay_ms_one_way: f64::NAN, ..ok };
        assert!(matches!(nan.validate(), Err(ParamsError::Delay(_))));
        let lossy = LinkParams { loss_percent: 1.0, ..ok };
        assert_eq!(lossy.validate_for_proxy(), Err(ParamsError::LossInProxy));
    }

    #[test]
    fn serialisation_time() {
        let at = |rate| LinkParams { rate_mbit: Some(rate), ..LinkParams::default() };
        assert_eq!(at(8.0).serialisation_ns(1000), 1_000_000, "8000 bits at 8 bit/µs");
        assert_eq!(at(124.0).serialisation_ns(1500), 96_774);
        assert_eq!(LinkParams::default().serialisation_ns(1500), 0);
    }
}
