//! Spacing packets to the link's rate (a token bucket with a small burst), so that a sender
//! neither overruns the link's queue nor leaves it idle.

/// Times are microseconds of the caller's clock.
#[derive(Clone, Debug)]
pub struct Pacer {
    rate_bytes_per_s: u64,
    burst_bytes: u64,
    /// Bytes the bucket holds, scaled by 10^6 (byte-microseconds), at `at_us`.
    tokens: u128,
    at_us: u64,
}

impl Pacer {
    /// `rate_bytes_per_s` 0: unpaced.
    pub fn new(rate_bytes_per_s: u64, burst_bytes: u64, now_us: u64) -> Pacer {
        Pacer { rate_bytes_per_s, burst_bytes, tokens: burst_bytes as u128 * 1_000_000, at_us: now_us }
    }

    fn refill(&mut self, now_us: u64) {
        let elapsed = now_us.saturating_sub(self.at_us) as u128;
        let cap = self.burst_bytes as u128 * 1_000_000;
        self.tokens = (self.tokens + elapsed * self.rate_bytes_per_s as u128).min(cap);
        self.at_us = self.at_us.max(now_us);
    }

    /// When a packet of `bytes` may leave (now or later); taking it spends its tokens.
    pub fn send_at(&mut self, bytes: u64, now_us: u64) -> u64 {
        if self.rate_bytes_per_s == 0 {
            return now_us;
        }
        self.refill(now_us);
        let need = bytes as u128 * 1_000_000;
        if self.tokens >= need {
            self.tokens -= need;
            return now_us;
        }
        let wait_us = (need - self.tokens).div_ceil(self.rate_bytes_per_s as u128) as u64;
        // The packet leaves when the bucket has refilled enough; it spends all of it.
        self.tokens = 0;
        self.at_us = now_us + wait_us;
        now_us + wait_us
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_run_goes_at_the_rate_after_the_burst() {
        // 12.5 MB/s (100 Mbit/s), 1 500-byte packets, 15 000-byte burst.
        let mut p = Pacer::new(12_500_000, 15_000, 0);
        let mut last = 0;
        for _ in 0..10_000 {
            last = p.send_at(1_500, last);
        }
        // 15 MB after a 15 kB burst at 12.5 MB/s: 1.1988 s.
        let expected = (10_000 * 1_500 - 15_000) * 1_000_000 / 12_500_000;
        assert!(last.abs_diff(expected) <= 10, "{last} µs, expected {expected}");
        assert_eq!(Pacer::new(0, 0, 5).send_at(1 << 30, 7), 7, "unpaced");
    }
}
