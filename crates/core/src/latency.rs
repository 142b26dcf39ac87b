//! A latency histogram with fixed buckets: 50 µs doubling to about 1.6 s, then one beyond.
//! The host element keeps one per element for its acknowledgements; the shell's metrics use
//! the same buckets for NBD requests, so every latency on the metrics page reads alike.

/// Upper bound of the first bucket, in microseconds.
pub const FIRST_BOUND_US: u64 = 50;
/// Bounded buckets (each bound twice the one before); one more bucket holds the rest.
pub const BOUNDED_BUCKETS: usize = 16;

/// The bucket a latency falls in: the first whose bound is at least `us` (as Prometheus'
/// `le`), or [`BOUNDED_BUCKETS`] beyond the last bound.
pub fn bucket_of(us: u64) -> usize {
    let mut bound = FIRST_BOUND_US;
    let mut bucket = 0;
    while bucket < BOUNDED_BUCKETS && us > bound {
        bound *= 2;
        bucket += 1;
    }
    bucket
}

/// The buckets' upper bounds in seconds (not the last, unbounded one).
pub fn bounds_seconds() -> impl Iterator<Item = f64> {
    (0..BOUNDED_BUCKETS).map(|i| (FIRST_BOUND_US << i) as f64 / 1e6)
}

/// Latencies counted per bucket (not cumulative), with their count and sum.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LatencyHistogram {
    pub buckets: [u64; BOUNDED_BUCKETS + 1],
    pub count: u64,
    pub sum_us: u64,
}

impl LatencyHistogram {
    pub fn observe(&mut self, us: u64) {
        self.buckets[bucket_of(us)] += 1;
        self.count += 1;
        self.sum_us = self.sum_us.saturating_add(us);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_fall_in_the_first_bucket_whose_bound_holds_them() {
        assert_eq!((bucket_of(0), bucket_of(50), bucket_of(51), bucket_of(100), bucket_of(101)), (0, 0, 1, 1, 2));
        let last = FIRST_BOUND_US << (BOUNDED_BUCKETS - 1);
        assert_eq!((bucket_of(last), bucket_of(last + 1), bucket_of(u64::MAX)), (15, 16, 16));
        let bounds: Vec<f64> = bounds_seconds().collect();
        assert_eq!((bounds.len(), bounds[0], bounds[15]), (BOUNDED_BUCKETS, 50e-6, 1.6384));
        let mut h = LatencyHistogram::default();
        h.observe(70);
        h.observe(10_000_000);
        assert_eq!((h.count, h.sum_us, h.buckets[1], h.buckets[16]), (2, 10_000_070, 1, 1));
    }
}
