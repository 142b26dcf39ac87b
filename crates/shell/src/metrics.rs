//! The host element's Prometheus metrics (`GET /metrics`), encoded by the `prometheus-client`
//! crate (OpenMetrics text: names, help, types, units and escaped label values are its
//! business). Two kinds:
//!
//! - measured as requests are answered ([`HostMetrics`], kept for the host element's life):
//!   NBD request latency histograms, bytes and errors, per volume and operation;
//! - read from the core's status at each scrape (every gauge and the read cache's counters).
//!
//! Each scrape builds a registry of both (the measured families are shared handles) and
//! encodes it once. An example Grafana dashboard is `docs/grafana-dashboard.json`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use starfish_core::groups::ExportedVolume;
use starfish_core::latency::{self, LatencyHistogram};
use starfish_core::{HostStatus, VolumeMode};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RequestLabels {
    pub volume: String,
    /// read, write, write_zeroes, trim, flush, block_status.
    pub op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ErrorLabels {
    pub volume: String,
    pub op: &'static str,
    /// The NBD error the client got (EIO, EPERM, ...).
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VolumeLabels {
    volume: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ElementLabels {
    element: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ElementFailureLabels {
    element: String,
    /// `Failure::kind`: fenced, refused, connection_lost, heartbeat_timeout, ...
    reason: String,
}

/// Histograms the core measured (one per element): encoded as they are, since
/// prometheus-client's own `Histogram` is only filled by observing.
#[derive(Debug)]
struct MeasuredHistograms(Vec<(ElementLabels, LatencyHistogram)>);

impl EncodeMetric for MeasuredHistograms {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let bounds: Vec<f64> = latency::bounds_seconds().chain([f64::INFINITY]).collect();
        for (labels, h) in &self.0 {
            let buckets: Vec<(f64, u64)> = bounds.iter().copied().zip(h.buckets.iter().copied()).collect();
            let sum = h.sum_us as f64 / 1e6;
            encoder.encode_family(labels)?.encode_histogram::<NoLabelSet>(sum, h.count, &buckets, None)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ElementStateLabels {
    element: String,
    state: String,
}

type LatencyFamily = Family<RequestLabels, Histogram, fn() -> Histogram>;

/// Every latency on the page has the core's buckets: 50 µs doubling to about 1.6 s.
fn latency_histogram() -> Histogram {
    Histogram::new(latency::bounds_seconds())
}

/// The latency buckets' upper bounds in seconds (the last bucket, beyond them, is unbounded).
pub(crate) fn latency_bounds() -> Vec<f64> {
    latency::bounds_seconds().collect()
}

/// Requests of one kind answered so far and how many fell in each latency bucket (the
/// histogram's buckets, not cumulative; one more than [`latency_bounds`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct KindTotals {
    pub requests: u64,
    pub buckets: Vec<u64>,
}

/// What the status page charts, summed over volumes: reads, and writes of every kind (write,
/// write zeroes, trim). The prometheus-client histograms do not give their buckets back, so
/// these few counters are kept beside them.
#[derive(Debug, Default)]
struct ChartCounters {
    read: KindCounters,
    write: KindCounters,
}

#[derive(Debug, Default)]
struct KindCounters {
    requests: AtomicU64,
    buckets: [AtomicU64; latency::BOUNDED_BUCKETS + 1],
}

impl KindCounters {
    fn observe(&self, took: Duration) {
        self.buckets[latency::bucket_of(took.as_micros() as u64)].fetch_add(1, Ordering::Relaxed);
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    fn totals(&self) -> KindTotals {
        KindTotals {
            requests: self.requests.load(Ordering::Relaxed),
            buckets: self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect(),
        }
    }
}

/// What is measured as requests are answered; cheap to clone (shared handles).
#[derive(Clone, Debug)]
pub(crate) struct HostMetrics {
    families: RequestFamilies,
    /// Each volume's handles into the families, made at its first request: a request then
    /// builds no label set and allocates nothing ([`HostMetrics::volume`]).
    volumes: Arc<RwLock<HashMap<String, Arc<VolumeRequestMetrics>>>>,
}

/// The families of request metrics and the charts' counters (shared handles).
#[derive(Clone, Debug)]
struct RequestFamilies {
    request_seconds: LatencyFamily,
    request_bytes: Family<RequestLabels, Counter>,
    request_errors: Family<ErrorLabels, Counter>,
    charts: Arc<ChartCounters>,
}

impl Default for HostMetrics {
    fn default() -> Self {
        HostMetrics {
            families: RequestFamilies {
                request_seconds: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
                request_bytes: Family::default(),
                request_errors: Family::default(),
                charts: Arc::default(),
            },
            volumes: Arc::default(),
        }
    }
}

/// The operations requests are counted under (the `op` label).
const OPS: [&str; 6] = ["read", "write", "write_zeroes", "trim", "flush", "block_status"];

/// One volume's request metrics: its series in the families, each taken at its first use (so
/// the page shows only what happened, as the families alone do).
#[derive(Debug)]
pub(crate) struct VolumeRequestMetrics {
    volume: String,
    families: RequestFamilies,
    seconds: [OnceLock<Histogram>; OPS.len()],
    bytes: [OnceLock<Counter>; OPS.len()],
}

impl VolumeRequestMetrics {
    /// One NBD request answered: its latency, the bytes it moved (reads and writes), and its
    /// error if it failed.
    pub fn request(&self, op: &'static str, bytes: u64, took: Duration, error: Option<String>) {
        let families = &self.families;
        let labels = || RequestLabels { volume: self.volume.clone(), op };
        let known = OPS.iter().position(|known| *known == op);
        let seconds = took.as_secs_f64();
        match known {
            Some(i) => self.seconds[i]
                .get_or_init(|| families.request_seconds.get_or_create(&labels()).clone())
                .observe(seconds),
            None => families.request_seconds.get_or_create(&labels()).observe(seconds),
        }
        match op {
            "read" => families.charts.read.observe(took),
            "write" | "write_zeroes" | "trim" => families.charts.write.observe(took),
            _ => {}
        }
        match error {
            None if bytes == 0 => {}
            None => {
                match known {
                    Some(i) => self.bytes[i]
                        .get_or_init(|| families.request_bytes.get_or_create(&labels()).clone())
                        .inc_by(bytes),
                    None => families.request_bytes.get_or_create(&labels()).inc_by(bytes),
                };
            }
            Some(error) => {
                let labels = ErrorLabels { volume: self.volume.clone(), op, error };
                families.request_errors.get_or_create(&labels).inc();
            }
        }
    }
}

impl HostMetrics {
    /// `volume`'s request metrics, to count its requests with.
    pub fn volume(&self, volume: &str) -> Arc<VolumeRequestMetrics> {
        if let Some(metrics) = self.volumes.read().expect("no panic while holding this lock").get(volume) {
            return metrics.clone();
        }
        let mut volumes = self.volumes.write().expect("no panic while holding this lock");
        volumes
            .entry(volume.to_string())
            .or_insert_with(|| {
                Arc::new(VolumeRequestMetrics {
                    volume: volume.to_string(),
                    families: self.families.clone(),
                    seconds: Default::default(),
                    bytes: Default::default(),
                })
            })
            .clone()
    }

    /// One NBD request of `volume` answered (see [`VolumeRequestMetrics::request`]).
    #[cfg(test)]
    pub fn request(&self, volume: &str, op: &'static str, bytes: u64, took: Duration, error: Option<String>) {
        self.volume(volume).request(op, bytes, took, error);
    }

    /// Reads and writes answered so far, with their latency buckets (the status page's charts).
    pub fn chart_totals(&self) -> (KindTotals, KindTotals) {
        (self.families.charts.read.totals(), self.families.charts.write.totals())
    }

    /// The metrics page: whether this host element is the active one, what was measured, and
    /// what `status` (with the exports and the NBD connections per export) says now (`None`: a
    /// standby, which serves nothing).
    pub fn encode(
        &self,
        active: bool,
        now: Option<(&HostStatus, &[ExportedVolume], &HashMap<String, usize>)>,
    ) -> String {
        let mut registry = Registry::with_prefix("starfish");
        let role = Gauge::<i64>::default();
        role.set(active as i64);
        registry.register("host_active", "1 on the active host element, 0 on a standby", role);
        let Some((status, exports, clients)) = now else {
            return encode_registry(&registry);
        };
        registry.register_with_unit(
            "host_request_duration",
            "Latency of NBD requests, from arrival to answer",
            Unit::Seconds,
            self.families.request_seconds.clone(),
        );
        registry.register_with_unit(
            "host_request",
            "Bytes read and written by NBD requests that succeeded",
            Unit::Bytes,
            self.families.request_bytes.clone(),
        );
        registry.register(
            "host_request_errors",
            "NBD requests answered with an error",
            self.families.request_errors.clone(),
        );
        register_status(&mut registry, status, exports, clients);
        encode_registry(&registry)
    }
}

fn encode_registry(registry: &Registry) -> String {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry).expect("writing to a String cannot fail");
    out
}

fn gauge_family<L: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    values: impl IntoIterator<Item = (L, i64)>,
) {
    let family = Family::<L, Gauge>::default();
    for (labels, value) in values {
        family.get_or_create(&labels).set(value);
    }
    match unit {
        Some(unit) => registry.register_with_unit(name, help, unit, family),
        None => registry.register(name, help, family),
    }
}

fn register_status(
    registry: &mut Registry,
    status: &HostStatus,
    exports: &[ExportedVolume],
    clients: &HashMap<String, usize>,
) {
    let epoch = Gauge::<i64>::default();
    epoch.set(status.epoch.0 as i64);
    registry.register("host_epoch", "The epoch this host element serves in", epoch);
    let ready = Gauge::<i64>::default();
    ready.set(status.ready as i64);
    registry.register("host_ready", "1 once the host element made its start-up decision and serves", ready);

    // Per exported volume (a consistency group's members share their storage volume's state);
    // the catalog and removed volumes are not exported, so not reported.
    let per_export = |value: &dyn Fn(&starfish_core::VolumeStatus) -> i64| -> Vec<(VolumeLabels, i64)> {
        exports
            .iter()
            .filter_map(|e| {
                let v = status.volumes.get(e.volume)?;
                Some((VolumeLabels { volume: e.name.clone() }, value(v)))
            })
            .collect()
    };
    gauge_family(
        registry,
        "volume_read_only",
        "1 while fewer than the write quorum of elements are in sync (writes refused)",
        None,
        per_export(&|v| (v.mode == VolumeMode::ReadOnly) as i64),
    );
    gauge_family(
        registry,
        "volume_acked_sequence",
        "Highest sequence acknowledged to NBD clients as written",
        None,
        per_export(&|v| v.acked_sequence.0 as i64),
    );
    gauge_family(
        registry,
        "write_queue_used",
        "Bytes of the volume's write queue in use",
        Some(Unit::Bytes),
        per_export(&|v| v.write_queue_used_bytes as i64),
    );
    gauge_family(
        registry,
        "write_queue_capacity",
        "Size of the volume's write queue",
        Some(Unit::Bytes),
        per_export(&|v| v.write_queue_capacity_bytes as i64),
    );
    gauge_family(
        registry,
        "volume_writes_waiting",
        "Writes waiting for room in the write queue",
        None,
        per_export(&|v| v.writes_waiting as i64),
    );
    gauge_family(
        registry,
        "volume_beginning_unheld",
        "1 while fewer than Q elements hold this host element's beginning record of the volume (weaker ack policies)",
        None,
        per_export(&|v| i64::from(v.beginning.is_some())),
    );
    gauge_family(
        registry,
        "volume_reads_held_for_beginning",
        "Reads waiting until Q elements hold the volume's beginning record",
        None,
        per_export(&|v| v.beginning.map_or(0, |b| b.reads_held as i64)),
    );
    let connections = exports
        .iter()
        .map(|e| (VolumeLabels { volume: e.name.clone() }, clients.get(&e.name).copied().unwrap_or(0) as i64));
    gauge_family(registry, "nbd_connections", "NBD connections in the transmission phase", None, connections);
    type ScrubValue = fn(&starfish_core::ScrubStatus) -> i64;
    let scrubs: [(&str, &str, ScrubValue); 6] = [
        ("scrub_running", "1 while a scrub of the volume runs", |s| s.running as i64),
        ("scrub_done_bytes", "Bytes the running (else last) scrub compared", |s| s.done_bytes as i64),
        ("scrub_total_bytes", "Bytes the running (else last) scrub compares", |s| s.total_bytes as i64),
        ("scrub_mismatched_blocks", "Blocks the last scrub found differing", |s| s.findings.blocks_mismatched as i64),
        ("scrub_undecided_blocks", "Blocks differing with no majority", |s| s.findings.blocks_undecided as i64),
        ("scrub_element_errors", "Elements that could not scrub", |s| s.findings.element_errors as i64),
    ];
    for (name, help, value) in scrubs {
        let values = exports.iter().filter_map(|e| {
            let scrub = status.volumes.get(e.volume)?.scrubs.last()?;
            Some((VolumeLabels { volume: e.name.clone() }, value(scrub)))
        });
        gauge_family(registry, name, help, None, values);
    }

    let element = |name: &str| ElementLabels { element: name.to_string() };
    gauge_family(
        registry,
        "element_in_sync",
        "1 while the element is in sync",
        None,
        status.elements.iter().map(|e| (element(&e.name), (e.state == "in-sync") as i64)),
    );
    let states = status.elements.iter().flat_map(|e| {
        ["in-sync", "recovering", "failed"].into_iter().map(move |state| {
            (ElementStateLabels { element: e.name.clone(), state: state.to_string() }, (e.state == state) as i64)
        })
    });
    gauge_family(registry, "element_state", "1 for the element's current state", None, states);
    gauge_family(
        registry,
        "element_lag_writes",
        "Writes the element is behind the newest assigned, summed over volumes",
        None,
        status.elements.iter().map(|e| (element(&e.name), e.lag as i64)),
    );
    let acks = status.elements.iter().map(|e| (element(&e.name), e.ack_latency.clone())).collect();
    registry.register_with_unit(
        "element_ack_latency",
        "Latency of the element's acknowledgements that count under its ack policy, from the write's sequence assignment, while in sync",
        Unit::Seconds,
        MeasuredHistograms(acks),
    );
    let failures = Family::<ElementFailureLabels, Counter>::default();
    for e in &status.elements {
        for (reason, n) in &e.failures {
            let labels = ElementFailureLabels { element: e.name.clone(), reason: reason.to_string() };
            failures.get_or_create(&labels).inc_by(*n);
        }
    }
    registry.register(
        "element_failures",
        "Times the element failed, by reason (fenced: it follows a newer host element; refused: it refused our session)",
        failures,
    );
    let rtt = Family::<ElementLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    for e in &status.elements {
        if let Some(us) = e.rtt_us {
            rtt.get_or_create(&element(&e.name)).set(us as f64 / 1e6);
        }
    }
    registry.register_with_unit("element_rtt", "Round-trip time of the element's heartbeat", Unit::Seconds, rtt);
    let recovering: Vec<_> =
        status.elements.iter().filter_map(|e| e.recovery.as_ref().map(|r| (element(&e.name), r))).collect();
    gauge_family(
        registry,
        "element_recovery_done_records",
        "Records a replay or quick recovery brought so far",
        None,
        recovering.iter().map(|(l, r)| (l.clone(), r.done_records as i64)),
    );
    gauge_family(
        registry,
        "element_recovery_total_records",
        "Records the recovery brings in all",
        None,
        recovering.iter().map(|(l, r)| (l.clone(), r.total_records as i64)),
    );
    gauge_family(
        registry,
        "element_recovery_done",
        "Bytes a full recovery (block copy) compared so far",
        Some(Unit::Bytes),
        recovering.iter().filter_map(|(l, r)| Some((l.clone(), r.copy_done_bytes? as i64))),
    );
    gauge_family(
        registry,
        "element_recovery_total",
        "Bytes a full recovery (block copy) compares in all",
        Some(Unit::Bytes),
        recovering.iter().filter_map(|(l, r)| Some((l.clone(), r.copy_total_bytes? as i64))),
    );
    gauge_family(
        registry,
        "element_recovery_copied",
        "Bytes a full recovery copied so far (those that differed)",
        Some(Unit::Bytes),
        recovering.iter().filter_map(|(l, r)| Some((l.clone(), r.copied_bytes? as i64))),
    );

    gauge_family(
        registry,
        "element_reads_out",
        "Reply bytes of the reads out at the element",
        Some(Unit::Bytes),
        status.elements.iter().map(|e| (element(&e.name), e.reads_out_bytes as i64)),
    );
    gauge_family(
        registry,
        "element_read_window",
        "The most reply bytes of reads out at the element at once (what its replies delivered in 100 ms, at least 1 MiB)",
        Some(Unit::Bytes),
        status.elements.iter().filter_map(|e| Some((element(&e.name), e.read_window_bytes? as i64))),
    );
    let waiting = Gauge::<i64>::default();
    waiting.set(status.reads_waiting as i64);
    registry.register(
        "reads_waiting",
        "Reads waiting in the host element for room in an element's read window",
        waiting,
    );

    let hits = Counter::<u64>::default();
    hits.inc_by(status.read_cache_hits);
    registry.register("read_cache_hits", "Reads answered from the host element's read cache", hits);
    let misses = Counter::<u64>::default();
    misses.inc_by(status.read_cache_misses);
    registry.register("read_cache_misses", "Reads the read cache could not answer", misses);
    let declined = Counter::<u64>::default();
    declined.inc_by(status.read_cache_declined);
    registry.register(
        "read_cache_declined",
        "Blocks reads missed that the read cache did not take (it takes one on its second miss)",
        declined,
    );
    let used = Gauge::<i64>::default();
    used.set(status.read_cache_used_bytes as i64);
    registry.register_with_unit("read_cache_used", "Bytes held by the read cache", Unit::Bytes, used);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::Epoch;
    use starfish_core::{HostConfig, HostCore, RecoveryKind, RecoveryStatus, Time};

    /// A page with something in every family: a recovery copying blocks, a failed request.
    fn page() -> String {
        let volumes =
            vec![proto::VolumeSpec { name: "vol0".into(), size_bytes: 1 << 20, clone_of: None, at_least: false }];
        let config = HostConfig::new(Epoch(1), 2, vec!["a".into(), "b".into(), "c".into()], volumes);
        let exports = config.exported();
        let mut status = HostCore::new(config, Time(0)).status(Time(0));
        status.elements[2].recovery = Some(RecoveryStatus {
            kind: RecoveryKind::Full,
            source: Some("a".into()),
            done_records: 3,
            total_records: 9,
            copy_done_bytes: Some(4096),
            copy_total_bytes: Some(1 << 20),
            copied_bytes: Some(4096),
            elapsed_us: 1000,
            waiting_for_source: Vec::new(),
        });
        status.elements[0].rtt_us = Some(250);
        status.elements[1].ack_latency.observe(70);
        status.elements[1].failures = vec![("fenced", 2)];
        let metrics = HostMetrics::default();
        metrics.request("vol0", "write", 4096, Duration::from_micros(300), None);
        metrics.request("vol0", "read", 0, Duration::from_micros(90), Some("EIO".into()));
        let clients = HashMap::from([("vol0".to_string(), 2)]);
        metrics.encode(true, Some((&status, &exports, &clients)))
    }

    /// Requests counted through a volume's handles land in the families' series of that volume
    /// and operation, and only operations that happened show.
    #[test]
    fn requests_counted_through_a_volumes_handles_show_per_volume_and_operation() {
        let volumes = ["vol0", "vol1"]
            .map(|name| proto::VolumeSpec { name: name.into(), size_bytes: 1 << 20, clone_of: None, at_least: false })
            .to_vec();
        let config = HostConfig::new(Epoch(1), 2, vec!["a".into(), "b".into(), "c".into()], volumes);
        let exports = config.exported();
        let status = HostCore::new(config, Time(0)).status(Time(0));
        let metrics = HostMetrics::default();
        let vol0 = metrics.volume("vol0");
        assert!(Arc::ptr_eq(&vol0, &metrics.volume("vol0")), "one set of handles per volume");
        for _ in 0..3 {
            vol0.request("write", 4096, Duration::from_micros(300), None);
        }
        metrics.volume("vol1").request("read", 8192, Duration::from_micros(90), None);
        metrics.volume("vol1").request("read", 0, Duration::from_micros(90), Some("EIO".into()));
        let clients = HashMap::new();
        let page = metrics.encode(true, Some((&status, &exports, &clients)));
        let line = |prefix: &str| {
            page.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix} in\n{page}")).to_string()
        };
        assert!(line("starfish_host_request_duration_seconds_count{volume=\"vol0\",op=\"write\"}").ends_with(" 3"));
        assert!(line("starfish_host_request_bytes_total{volume=\"vol0\",op=\"write\"}").ends_with(" 12288"));
        assert!(line("starfish_host_request_duration_seconds_count{volume=\"vol1\",op=\"read\"}").ends_with(" 2"));
        assert!(line("starfish_host_request_bytes_total{volume=\"vol1\",op=\"read\"}").ends_with(" 8192"));
        assert!(line("starfish_host_request_errors_total{volume=\"vol1\",op=\"read\",error=\"EIO\"}").ends_with(" 1"));
        assert!(!page.contains("op=\"trim\""), "no series for an operation that did not happen");
        assert!(!page.contains("volume=\"vol1\",op=\"write\""));
    }

    #[test]
    fn chart_totals_count_requests_in_the_histograms_buckets() {
        let metrics = HostMetrics::default();
        metrics.request("v", "write", 4096, Duration::from_micros(50), None);
        metrics.request("v", "trim", 0, Duration::from_micros(51), None);
        metrics.request("v", "read", 4096, Duration::from_secs(10), None);
        metrics.request("v", "flush", 0, Duration::from_millis(1), None);
        let (read, write) = metrics.chart_totals();
        let bounds = latency_bounds();
        assert_eq!(bounds.len() + 1, write.buckets.len());
        assert_eq!((read.requests, write.requests), (1, 2));
        // 50 µs is the first bound (inclusive, as Prometheus' `le`); 51 µs is the next bucket.
        assert_eq!(&write.buckets[..3], &[1, 1, 0]);
        assert_eq!(read.buckets.last(), Some(&1), "beyond the last bound: the unbounded bucket");
    }

    #[test]
    fn the_page_declares_what_the_grafana_dashboard_asks_for() {
        let page = page();
        assert!(page.ends_with("# EOF\n"), "OpenMetrics text ends with # EOF");
        assert!(page.contains("starfish_nbd_connections{volume=\"vol0\"} 2"), "{page}");
        assert!(page.contains("starfish_host_request_errors_total{volume=\"vol0\",op=\"read\",error=\"EIO\"} 1"));
        assert!(page.contains("starfish_host_request_duration_seconds_count{volume=\"vol0\",op=\"write\"} 1"));
        assert!(page.contains("starfish_element_ack_latency_seconds_bucket{le=\"0.0001\",element=\"b\"} 1"), "{page}");
        assert!(page.contains("starfish_element_ack_latency_seconds_count{element=\"a\"} 0"), "{page}");
        assert!(page.contains("starfish_element_failures_total{element=\"b\",reason=\"fenced\"} 2"), "{page}");
        assert!(page.contains("starfish_element_read_window_bytes{element=\"a\"} 1048576"), "{page}");
        assert!(page.contains("starfish_element_reads_out_bytes{element=\"c\"} 0"), "{page}");
        assert!(page.contains("starfish_reads_waiting 0"), "{page}");
        let declared: Vec<&str> =
            page.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split(' ').next()).collect();
        let dashboard: serde_json::Value =
            serde_json::from_str(include_str!("../../../docs/grafana-dashboard.json")).expect("the dashboard is JSON");
        let mut asked = Vec::new();
        for panel in dashboard["panels"].as_array().expect("panels") {
            for target in panel["targets"].as_array().expect("targets") {
                let expr = target["expr"].as_str().expect("an expression");
                for (at, _) in expr.match_indices("starfish_") {
                    let name: String =
                        expr[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    asked.push(name);
                }
            }
        }
        assert!(asked.len() >= 16, "{asked:?}");
        for name in asked {
            let base = ["_bucket", "_count", "_sum", "_total"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(&name);
            assert!(declared.contains(&base), "the dashboard asks for {name}, which the page does not declare");
        }
    }
}
