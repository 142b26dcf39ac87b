//! Configured against observed delay and rate, with tolerances. These assert timings, which a
//! busy machine breaks, so they are ignored by default (STYLE.md: "never assert a timing in a
//! test"); run them on a quiet machine, as root for the namespace ones:
//!
//!     cargo test --release -p netem --test fidelity -- --ignored --nocapture --test-threads=1
//!
//! Tolerances: one-way delay mean within [d, d + 0.5 ms], median within [d, d + 0.3 ms], 99th
//! percentile below d + 3 ms; rate within ±10 % (IP bytes per second in namespace mode,
//! payload in proxy mode). docs/link-emulation.md has the measured figures.

use std::time::Duration;

use netem::measure::{self, MeasureOptions, Report};
use netem::{Link, LinkParams, LinkSpec};

const DELAYS_MS: [f64; 3] = [1.0, 8.0, 30.0];
const RATES_MBIT: [f64; 2] = [31.0, 124.0];

fn delay_options() -> MeasureOptions {
    MeasureOptions { samples: 200, gap: Duration::from_millis(2), bulk: Duration::ZERO, ..MeasureOptions::default() }
}

fn rate_options() -> MeasureOptions {
    MeasureOptions {
        samples: 50,
        bulk: Duration::from_secs(5),
        warmup: Duration::from_secs(1),
        ..MeasureOptions::default()
    }
}

fn check_delay(report: &Report) {
    let d = report.params.delay_ms_one_way;
    let o = &report.one_way;
    eprintln!("{}", report.row());
    assert!(o.min_ms >= d, "{d} ms: a packet arrived early ({} ms)", o.min_ms);
    assert!(o.mean_ms <= d + 0.5, "{d} ms: mean {} ms", o.mean_ms);
    assert!(o.p50_ms <= d + 0.3, "{d} ms: median {} ms", o.p50_ms);
    assert!(o.p99_ms <= d + 3.0, "{d} ms: 99th percentile {} ms", o.p99_ms);
}

fn check_rate(report: &Report, observed_mbit: f64) {
    let rate = report.params.rate_mbit.expect("a rate");
    eprintln!("{}", report.row());
    assert!((observed_mbit - rate).abs() <= rate * 0.1, "{rate} Mbit/s configured, {observed_mbit:.1} Mbit/s observed");
}

fn link(params: LinkParams) -> Link {
    Link::create(LinkSpec { params, ..LinkSpec::default() })
        .expect("the link comes up (needs root, iproute2, /dev/net/tun)")
}

#[test]
#[ignore = "timing: run on a quiet machine as root with --ignored"]
fn netns_delay() {
    eprintln!("{}", Report::header());
    for d in DELAYS_MS {
        let link = link(LinkParams { delay_ms_one_way: d, ..LinkParams::default() });
        check_delay(&measure::measure_link(&link, &delay_options()).expect("measured"));
    }
}

#[test]
#[ignore = "timing: run on a quiet machine as root with --ignored"]
fn netns_rate() {
    eprintln!("{}", Report::header());
    for rate in RATES_MBIT {
        let link = link(LinkParams { delay_ms_one_way: 8.0, rate_mbit: Some(rate), ..LinkParams::default() });
        let report = measure::measure_link(&link, &rate_options()).expect("measured");
        let wire = report.transfer.and_then(|t| t.wire_mbit).expect("a transfer");
        check_rate(&report, wire);
    }
}

#[test]
#[ignore = "timing: run on a quiet machine with --ignored"]
fn proxy_delay() {
    eprintln!("{}", Report::header());
    for d in DELAYS_MS {
        check_delay(
            &measure::measure_proxy(LinkParams { delay_ms_one_way: d, ..LinkParams::default() }, &delay_options())
                .expect("measured"),
        );
    }
}

#[test]
#[ignore = "timing: run on a quiet machine with --ignored"]
fn proxy_rate() {
    eprintln!("{}", Report::header());
    for rate in RATES_MBIT {
        let params = LinkParams { delay_ms_one_way: 8.0, rate_mbit: Some(rate), ..LinkParams::default() };
        let report = measure::measure_proxy(params, &rate_options()).expect("measured");
        let goodput = report.transfer.expect("a transfer").goodput_mbit;
        check_rate(&report, goodput);
    }
}
