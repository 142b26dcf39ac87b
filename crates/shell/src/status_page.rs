//! The live status page (`GET /` on the admin address) and its feed (`GET /events`,
//! server-sent events).
//!
//! Once a second the host element samples itself ([`Feed::publish`], from `node.rs`): the
//! status document (the one `starfish status --json` prints) and a [`Sample`] for the charts —
//! read and write IOPS, their latency percentiles (from the request histograms' buckets) and
//! the recovery rate. The last [`HISTORY_SAMPLES`] samples are kept. A page that connects
//! gets them (`event: history`), then each new status and sample (`event: update`); however
//! many pages are open, the core is asked once a second.
//!
//! The page (`status_page.html`) is one file built into the binary: no build step, nothing
//! fetched from elsewhere (its Content-Security-Policy forbids it).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::{watch, Semaphore};

use crate::metrics::{latency_bounds, KindTotals};

/// The page itself.
pub(crate) const PAGE_HTML: &str = include_str!("status_page.html");
/// What the page may load: nothing beyond itself and its feed.
pub(crate) const PAGE_CSP: &str =
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:";
/// How often the host element samples itself for the page.
pub(crate) const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// Samples kept for the charts: five minutes.
pub(crate) const HISTORY_SAMPLES: usize = 300;
/// Pages following the feed at once (each holds one of the admin address's connections).
pub(crate) const EVENT_STREAMS_MAX: usize = 8;
/// A feed connection ends after this; the browser reconnects by itself (`retry`).
pub(crate) const EVENT_STREAM_LIFETIME: Duration = Duration::from_secs(600);

/// One point of the page's charts: what happened during the second before `t_ms`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct Sample {
    /// Milliseconds since the Unix epoch.
    pub t_ms: u64,
    pub read_iops: f64,
    pub write_iops: f64,
    /// Latency percentiles in milliseconds (none without requests in the interval).
    pub read_p50_ms: Option<f64>,
    pub read_p99_ms: Option<f64>,
    pub write_p50_ms: Option<f64>,
    pub write_p99_ms: Option<f64>,
    /// Bytes compared per second by block copies, and records brought per second by replays
    /// and quick recoveries, summed over the elements recovering.
    pub recovery_bytes_per_s: f64,
    pub recovery_records_per_s: f64,
    /// Per element: the 99th percentile of its acknowledgements' latency in the interval, in
    /// milliseconds (none without acknowledgements; see `starfish_element_ack_latency_seconds`).
    pub ack_p99_ms: BTreeMap<String, Option<f64>>,
}

/// The running totals a [`Sample`] is the difference of.
#[derive(Clone, Debug)]
pub(crate) struct Totals {
    pub at: Instant,
    pub reads: KindTotals,
    pub writes: KindTotals,
    /// Per recovering element: bytes compared so far (block copy) and records brought.
    pub recovery: HashMap<String, (u64, u64)>,
    /// Per element: its acknowledgements counted per latency bucket so far.
    pub acks: Vec<(String, KindTotals)>,
}

impl Totals {
    pub fn new(at: Instant, charts: (KindTotals, KindTotals), status: &starfish_core::HostStatus) -> Totals {
        let recovery = status
            .elements
            .iter()
            .filter_map(|e| {
                let r = e.recovery.as_ref()?;
                Some((e.name.clone(), (r.copy_done_bytes.unwrap_or(0), r.done_records)))
            })
            .collect();
        let acks = status
            .elements
            .iter()
            .map(|e| {
                let h = &e.ack_latency;
                (e.name.clone(), KindTotals { requests: h.count, buckets: h.buckets.to_vec() })
            })
            .collect();
        Totals { at, reads: charts.0, writes: charts.1, recovery, acks }
    }
}

/// The `q` quantile (0 < q ≤ 1) of the latencies counted in `buckets` (one per bound of
/// `bounds`, then one beyond them), in seconds: linear within the bucket it falls in, as
/// Prometheus' `histogram_quantile`; the last bound if it falls beyond them; none if empty.
pub(crate) fn quantile(bounds: &[f64], buckets: &[u64], q: f64) -> Option<f64> {
    debug_assert_eq!(bounds.len() + 1, buckets.len());
    let total: u64 = buckets.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut below = 0u64;
    for (i, &count) in buckets.iter().enumerate() {
        if count > 0 && (below + count) as f64 >= rank {
            let Some(&upper) = bounds.get(i) else { return bounds.last().copied() };
            let lower = if i == 0 { 0.0 } else { bounds[i - 1] };
            let within = ((rank - below as f64) / count as f64).clamp(0.0, 1.0);
            return Some(lower + (upper - lower) * within);
        }
        below += count;
    }
    bounds.last().copied()
}

/// What happened between two totals. A total that went down (a new active host element's
/// counters, a new recovery) counts from zero.
pub(crate) fn sample(before: &Totals, after: &Totals, t_ms: u64) -> Sample {
    let seconds = after.at.saturating_duration_since(before.at).as_secs_f64().max(1e-3);
    let bounds = latency_bounds();
    let delta = |b: &KindTotals, a: &KindTotals| -> (f64, Vec<u64>) {
        if a.requests < b.requests || a.buckets.len() != b.buckets.len() {
            return (a.requests as f64, a.buckets.clone());
        }
        let buckets = a.buckets.iter().zip(&b.buckets).map(|(a, b)| a.saturating_sub(*b)).collect();
        ((a.requests - b.requests) as f64, buckets)
    };
    let ms = |s: Option<f64>| s.map(|s| (s * 1e6).round() / 1e3);
    let ack_p99_ms = after
        .acks
        .iter()
        .map(|(element, now)| {
            let then = before.acks.iter().find(|(e, _)| e == element).map(|(_, t)| t.clone()).unwrap_or_default();
            let (_, buckets) = delta(&then, now);
            (element.clone(), ms(quantile(&bounds, &buckets, 0.99)))
        })
        .collect();
    let (reads, read_buckets) = delta(&before.reads, &after.reads);
    let (writes, write_buckets) = delta(&before.writes, &after.writes);
    let (mut bytes, mut records) = (0u64, 0u64);
    for (element, &(b_now, r_now)) in &after.recovery {
        let (b_then, r_then) = before.recovery.get(element).copied().unwrap_or((0, 0));
        bytes += if b_now >= b_then { b_now - b_then } else { b_now };
        records += if r_now >= r_then { r_now - r_then } else { r_now };
    }
    Sample {
        t_ms,
        read_iops: reads / seconds,
        write_iops: writes / seconds,
        read_p50_ms: ms(quantile(&bounds, &read_buckets, 0.5)),
        read_p99_ms: ms(quantile(&bounds, &read_buckets, 0.99)),
        write_p50_ms: ms(quantile(&bounds, &write_buckets, 0.5)),
        write_p99_ms: ms(quantile(&bounds, &write_buckets, 0.99)),
        recovery_bytes_per_s: bytes as f64 / seconds,
        recovery_records_per_s: records as f64 / seconds,
        ack_p99_ms,
    }
}

/// The page's feed: the samples kept, the newest update, and the pages following it.
#[derive(Debug)]
pub(crate) struct Feed {
    history: Mutex<VecDeque<Sample>>,
    /// The newest `update` event's data: `{"status": …, "sample": …}`.
    latest: watch::Sender<Option<Arc<str>>>,
    pub streams: Arc<Semaphore>,
}

impl Default for Feed {
    fn default() -> Self {
        Feed {
            history: Mutex::new(VecDeque::with_capacity(HISTORY_SAMPLES)),
            latest: watch::Sender::new(None),
            streams: Arc::new(Semaphore::new(EVENT_STREAMS_MAX)),
        }
    }
}

impl Feed {
    /// A new status document (none while the host element stops) and sample (none for the
    /// first one, or while nothing is measured: a standby).
    pub fn publish(&self, status: Option<Value>, sample: Option<Sample>) {
        if let Some(sample) = &sample {
            let mut history = self.history.lock().expect("history lock");
            if history.len() == HISTORY_SAMPLES {
                history.pop_front();
            }
            history.push_back(sample.clone());
        }
        let Some(status) = status else { return };
        let update = json!({ "status": status, "sample": sample });
        self.latest.send_replace(Some(update.to_string().into()));
    }

    /// The `history` event's data: `{"samples": […], "interval_ms": …}`.
    pub fn history_json(&self) -> String {
        let history = self.history.lock().expect("history lock");
        json!({ "samples": *history, "interval_ms": SAMPLE_INTERVAL.as_millis() as u64 }).to_string()
    }

    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<str>>> {
        self.latest.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(requests: u64, at: &[(usize, u64)]) -> KindTotals {
        let mut buckets = vec![0; latency_bounds().len() + 1];
        for &(i, n) in at {
            buckets[i] = n;
        }
        KindTotals { requests, buckets }
    }

    #[test]
    fn quantiles_interpolate_within_the_bucket_they_fall_in() {
        let bounds = [1.0, 2.0, 4.0];
        assert_eq!(quantile(&bounds, &[0, 0, 0, 0], 0.5), None);
        // 100 requests in (1, 2]: the median is half-way through that bucket.
        assert_eq!(quantile(&bounds, &[0, 100, 0, 0], 0.5), Some(1.5));
        assert_eq!(quantile(&bounds, &[0, 100, 0, 0], 1.0), Some(2.0));
        // 98 fast, 2 in (2, 4]: the 99th percentile is half-way through (2, 4].
        assert_eq!(quantile(&bounds, &[98, 0, 2, 0], 0.99), Some(3.0));
        assert_eq!(quantile(&bounds, &[98, 0, 2, 0], 0.5), Some(50.0 / 98.0));
        // Beyond the last bound: the last bound (as Prometheus does).
        assert_eq!(quantile(&bounds, &[0, 0, 0, 7], 0.5), Some(4.0));
    }

    #[test]
    fn a_sample_is_the_difference_of_two_totals() {
        let t0 = Instant::now();
        let before = Totals {
            at: t0,
            reads: kind(10, &[(0, 10)]),
            writes: kind(5, &[(3, 5)]),
            recovery: HashMap::from([("far".into(), (0, 100)), ("near".into(), (1 << 20, 0))]),
            acks: vec![("far".into(), kind(10, &[(0, 10)]))],
        };
        let after = Totals {
            at: t0 + Duration::from_secs(2),
            reads: kind(30, &[(0, 30)]),
            writes: kind(5, &[(3, 5)]),
            // far brought 300 more records; near's copy started again (its total went down).
            recovery: HashMap::from([("far".into(), (0, 400)), ("near".into(), (4096, 0))]),
            // far: 100 acknowledgements in (100 µs, 200 µs]; near: none counted yet.
            acks: vec![("far".into(), kind(110, &[(0, 10), (2, 100)])), ("near".into(), kind(0, &[]))],
        };
        let s = sample(&before, &after, 7);
        assert_eq!((s.t_ms, s.read_iops, s.write_iops), (7, 10.0, 0.0));
        assert_eq!((s.write_p50_ms, s.write_p99_ms), (None, None));
        // Every read in the first bucket (up to 50 µs): the median half-way into it.
        assert_eq!(s.read_p50_ms, Some(0.025));
        assert_eq!((s.recovery_records_per_s, s.recovery_bytes_per_s), (150.0, 2048.0));
        assert_eq!(s.ack_p99_ms["far"], Some(0.199), "99 % of the way through (100 µs, 200 µs]");
        assert_eq!(s.ack_p99_ms["near"], None);
        // A new host element's counters start again from zero: counted as they are.
        let restarted = Totals { at: t0 + Duration::from_secs(3), reads: kind(4, &[(1, 4)]), ..after.clone() };
        assert_eq!(sample(&after, &restarted, 8).read_iops, 4.0);
    }

    #[test]
    fn the_feed_keeps_the_last_five_minutes() {
        let feed = Feed::default();
        let mut rx = feed.subscribe();
        assert!(rx.borrow_and_update().is_none());
        let s = |t_ms| Sample {
            t_ms,
            read_iops: 0.0,
            write_iops: 1.0,
            read_p50_ms: None,
            read_p99_ms: None,
            write_p50_ms: Some(0.2),
            write_p99_ms: Some(0.9),
            recovery_bytes_per_s: 0.0,
            recovery_records_per_s: 0.0,
            ack_p99_ms: BTreeMap::new(),
        };
        for t in 0..(HISTORY_SAMPLES as u64 + 5) {
            feed.publish(Some(json!({ "epoch": 3 })), Some(s(t)));
        }
        let history: Value = serde_json::from_str(&feed.history_json()).expect("JSON");
        let samples = history["samples"].as_array().expect("samples");
        assert_eq!(samples.len(), HISTORY_SAMPLES);
        assert_eq!(samples[0]["t_ms"], 5, "the oldest samples were dropped");
        let update: Value = serde_json::from_str(&rx.borrow_and_update().clone().expect("an update")).expect("JSON");
        assert_eq!(update["status"]["epoch"], 3);
        assert_eq!(update["sample"]["t_ms"], HISTORY_SAMPLES as u64 + 4);
        // While stopping (no status) nothing new is sent, but the sample is kept.
        feed.publish(None, Some(s(1000)));
        assert!(!rx.has_changed().expect("the feed lives"));
    }

    /// The page's volume row reads a volume's `beginning` by the field names the admin server
    /// writes (`admin::beginning_json`). The browser test renders a row of that shape made by
    /// hand (no real cluster holds a beginning fewer than Q hold for long enough to look), so a
    /// field renamed on one side only would pass it; it fails here.
    #[test]
    fn the_page_reads_the_beginning_fields_the_admin_server_writes() {
        let written = crate::admin::beginning_json(Some(starfish_core::BeginningStatus {
            sequence: proto::Sequence(7),
            held_by: 1,
            reads_wait: true,
            reads_held: 2,
        }));
        let written = written.as_object().expect("an object");
        let start = PAGE_HTML.find("const b = v.beginning;").expect("the page shows a volume's beginning");
        let code = &PAGE_HTML[start..];
        let code = &code[..code.find("return el(").expect("then the row")];
        let identifier = |c: char| c.is_ascii_alphanumeric() || c == '_';
        let read: std::collections::BTreeSet<&str> = code
            .match_indices("b.")
            .filter(|(i, _)| !code[..*i].ends_with(identifier))
            .map(|(i, _)| {
                let field = &code[i + 2..];
                &field[..field.find(|c: char| !identifier(c)).unwrap_or(field.len())]
            })
            .collect();
        assert!(read.len() >= 3, "the row reads the beginning's fields: {read:?}");
        for field in read {
            assert!(
                written.contains_key(field),
                "the page reads beginning.{field}, which the admin server does not write"
            );
        }
    }
}
