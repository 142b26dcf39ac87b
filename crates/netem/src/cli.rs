//! `starfish link`: runs an emulated link from the command line (the binary mounts
//! [`LinkArgs`] as a subcommand and calls [`run`]). Three modes: a TCP proxy (`--listen`,
//! `--target`), a namespace link that prints its ends and holds them (`--netns`), and
//! `--measure`, which builds a link, measures it and prints configured against observed.
//! While a link is held, lines on stdin change it: `cut`, `heal`, `stats`, `set --delay-ms 30 …`.

use std::io::BufRead;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Parser;

use crate::limits::QUEUE_MS_DEFAULT;
use crate::link::{EndA, Link, LinkSpec, LinkStats, Side};
use crate::measure::{self, MeasureOptions, Report};
use crate::params::{BurstLoss, LinkParams};
use crate::proxy::Proxy;
use crate::sys;

const EXAMPLES: &str = "\
Examples:
  starfish link --delay-ms 8 --rate-mbit 124 --listen 127.0.0.1:9000 --target 127.0.0.1:7103
  starfish link --netns --delay-ms 8 --rate-mbit 124 --loss 0.1 --duration 60
  starfish link --netns --root-end --delay-ms 30 --burst-loss 0.01,0.3
  starfish link --measure --netns --delay-ms 8 --rate-mbit 124
  starfish link --measure --delay-ms 1 --delay-ms 8 --delay-ms 30      # proxy, one row each
  starfish link --cleanup

While a link is held, stdin takes: cut | heal | stats | set [--delay-ms MS] [--rate-mbit R|none] [--loss PCT] ...";

/// The link's parameters (shared by every mode, and by `set` on stdin).
#[derive(clap::Args, Debug, Clone)]
pub struct ParamsArgs {
    /// One-way delay, ms (the round trip is twice this). Repeat with --measure for one row each.
    #[arg(long = "delay-ms", value_name = "MS", default_value = "0")]
    pub delay_ms: Vec<f64>,
    /// Rate limit, Mbit/s, on IP packets (netns) or payload bytes (proxy); `none`: unlimited.
    /// Repeat with --measure for one row each.
    #[arg(long = "rate-mbit", value_name = "MBIT", value_parser = parse_rate)]
    pub rate_mbit: Vec<Option<f64>>,
    /// Independent random loss, percent of packets (netns mode only).
    #[arg(long = "loss", value_name = "PERCENT", default_value_t = 0.0)]
    pub loss_percent: f64,
    /// Bursty (Gilbert) loss: P_ENTER,P_EXIT per packet; mean loss P_ENTER/(P_ENTER+P_EXIT),
    /// mean burst 1/P_EXIT packets (netns mode only).
    #[arg(long, value_name = "P_ENTER,P_EXIT", value_parser = parse_burst)]
    pub burst_loss: Option<BurstLoss>,
    /// Bottleneck queue, ms at the rate; packets that would wait longer are dropped (netns mode
    /// only: the proxy holds bytes back from its sender instead).
    #[arg(long = "queue-ms", value_name = "MS", default_value_t = QUEUE_MS_DEFAULT)]
    pub queue_ms: f64,
}

/// Emulate a WAN link: one-way delay, rate limit, random and bursty loss, cut/heal.
///
/// Without --netns: a TCP proxy on --listen forwarding to --target (no root; no loss). With
/// --netns: two network namespaces joined through a userspace relay, real kernel TCP end to end
/// (needs root, iproute2 and /dev/net/tun); run servers with `ip netns exec NAME …`.
#[derive(clap::Args, Debug, Clone)]
#[command(after_help = EXAMPLES)]
pub struct LinkArgs {
    #[command(flatten)]
    pub params: ParamsArgs,
    /// Proxy mode: address to listen on.
    #[arg(long, requires = "target", conflicts_with_all = ["netns", "measure"])]
    pub listen: Option<SocketAddr>,
    /// Proxy mode: address to forward to.
    #[arg(long, requires = "listen")]
    pub target: Option<SocketAddr>,
    /// Namespace mode (root): a link between two network namespaces, or with --root-end
    /// between the root namespace and one namespace.
    #[arg(long)]
    pub netns: bool,
    /// Put end A in the root namespace, so that any local process reaches end B through the link.
    #[arg(long, requires = "netns")]
    pub root_end: bool,
    /// Seed of the loss model.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Stop after this many seconds (default: at Ctrl-C).
    #[arg(long, value_name = "SECONDS")]
    pub duration: Option<f64>,
    /// Measure configured against observed delay and rate, print a table and exit.
    #[arg(long)]
    pub measure: bool,
    /// --measure: idle round trips per row.
    #[arg(long, default_value_t = 100)]
    pub samples: usize,
    /// --measure: seconds of bulk transfer per row (0: delay only).
    #[arg(long, default_value_t = 5.0)]
    pub bulk_seconds: f64,
    /// --measure: print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Delete namespaces left behind by dead processes (`sfn-<pid>-…`) and exit.
    #[arg(long, conflicts_with_all = ["measure", "netns", "listen"])]
    pub cleanup: bool,
}

fn parse_rate(s: &str) -> Result<Option<f64>, String> {
    if s == "none" || s == "unlimited" {
        return Ok(None);
    }
    s.parse::<f64>().map(Some).map_err(|e| format!("{s}: {e}"))
}

fn parse_burst(s: &str) -> Result<BurstLoss, String> {
    let (enter, exit) = s.split_once(',').ok_or("expected P_ENTER,P_EXIT")?;
    let p = |v: &str| v.trim().parse::<f64>().map_err(|e| format!("{v}: {e}"));
    Ok(BurstLoss { p_enter: p(enter)?, p_exit: p(exit)? })
}

impl ParamsArgs {
    /// Every combination of the repeated delays and rates (one when neither is repeated).
    fn all(&self) -> Vec<LinkParams> {
        let rates = if self.rate_mbit.is_empty() { vec![None] } else { self.rate_mbit.clone() };
        let mut all = Vec::new();
        for &rate_mbit in &rates {
            for &delay_ms_one_way in &self.delay_ms {
                all.push(LinkParams {
                    delay_ms_one_way,
                    rate_mbit,
                    loss_percent: self.loss_percent,
                    burst_loss: self.burst_loss,
                    queue_ms_max: self.queue_ms,
                });
            }
        }
        all
    }

    fn single(&self) -> anyhow::Result<LinkParams> {
        let all = self.all();
        if all.len() != 1 {
            bail!("--delay-ms and --rate-mbit may be repeated only with --measure");
        }
        Ok(all[0])
    }
}

/// Runs `starfish link`.
pub fn run(args: &LinkArgs) -> anyhow::Result<()> {
    if args.cleanup {
        let removed = crate::netns::remove_leftovers()?;
        println!(
            "removed {} namespace(s){}",
            removed.len(),
            if removed.is_empty() { String::new() } else { format!(": {}", removed.join(" ")) }
        );
        return Ok(());
    }
    if args.measure {
        return run_measure(args);
    }
    let params = args.params.single()?;
    let stop = sys::catch_stop_signals();
    let deadline = args.duration.map(|s| Instant::now() + Duration::from_secs_f64(s));
    if let (Some(listen), Some(target)) = (args.listen, args.target) {
        let proxy = Proxy::start(listen, target, params).context("starting the link proxy")?;
        println!("link proxy {} -> {target}: {params}", proxy.address());
        return hold(&Held::Proxy(&proxy), stop, deadline);
    }
    if !args.netns {
        bail!("choose a mode: --listen/--target (proxy), --netns, --measure or --cleanup");
    }
    let end_a = if args.root_end { EndA::RootNamespace } else { EndA::Namespace };
    let link = Link::create(LinkSpec { params, end_a, seed: args.seed }).context("creating the link")?;
    println!("link up: {params}");
    for side in [Side::A, Side::B] {
        let end = link.end(side);
        let place = end.namespace.as_deref().map_or("root namespace".to_string(), |ns| format!("namespace {ns}"));
        println!("  end {side:?}: {} in {place} (device {})", end.address, end.device);
    }
    let b = link.end(Side::B);
    if let Some(ns) = &b.namespace {
        println!("run a server at end B:  ip netns exec {ns} starfish element --listen {}:7103 --data …", b.address);
    }
    match &link.end(Side::A).namespace {
        Some(ns) => println!("and its client at end A: ip netns exec {ns} …  (connect to {})", b.address),
        None => println!("and connect to {} from anywhere on this machine", b.address),
    }
    hold(&Held::Link(&link), stop, deadline)
}

enum Held<'a> {
    Link(&'a Link),
    Proxy(&'a Proxy),
}

impl Held<'_> {
    fn set(&self, params: LinkParams) -> anyhow::Result<()> {
        match self {
            Held::Link(link) => link.set(params)?,
            Held::Proxy(proxy) => proxy.set(params)?,
        }
        Ok(())
    }

    fn params(&self) -> LinkParams {
        match self {
            Held::Link(link) => link.params(),
            Held::Proxy(proxy) => proxy.params(),
        }
    }

    fn cut(&self, cut: bool) {
        match (self, cut) {
            (Held::Link(link), true) => link.cut(),
            (Held::Link(link), false) => link.heal(),
            (Held::Proxy(proxy), true) => proxy.cut(),
            (Held::Proxy(proxy), false) => proxy.heal(),
        }
    }

    fn stats(&self) -> LinkStats {
        match self {
            Held::Link(link) => link.stats(),
            Held::Proxy(proxy) => proxy.stats(),
        }
    }
}

/// Keeps the link until a stop signal, the deadline or `quit` on stdin; applies stdin commands.
fn hold(held: &Held<'_>, stop: &std::sync::atomic::AtomicBool, deadline: Option<Instant>) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::channel::<String>();
    // Detached: it may stay blocked on stdin until the process exits.
    std::thread::Builder::new().name("sfn-link-stdin".into()).spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    })?;
    loop {
        if stop.load(Ordering::SeqCst) || deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(line) => match apply_command(held, line.trim()) {
                Ok(Some(reply)) => println!("{reply}"),
                Ok(None) => break,
                Err(e) => println!("error: {e:#}"),
            },
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            // End of stdin (e.g. </dev/null) ends the commands, not the link.
            Err(mpsc::RecvTimeoutError::Disconnected) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    let stats = held.stats();
    println!("link down\n  a->b: {}\n  b->a: {}", stats.a_to_b, stats.b_to_a);
    Ok(())
}

/// Applies one stdin line; `Ok(None)` means quit.
fn apply_command(held: &Held<'_>, line: &str) -> anyhow::Result<Option<String>> {
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        [] => Ok(Some(String::new())),
        ["cut"] => {
            held.cut(true);
            Ok(Some("cut".into()))
        }
        ["heal"] => {
            held.cut(false);
            Ok(Some("healed".into()))
        }
        ["stats"] => Ok(Some(serde_json::to_string(&held.stats())?)),
        ["quit" | "exit"] => Ok(None),
        ["set", rest @ ..] => {
            let params = parse_set(held.params(), rest)?;
            held.set(params)?;
            Ok(Some(format!("set: {params}")))
        }
        _ => bail!("unknown command {line:?}: cut | heal | stats | quit | set [--delay-ms MS] [--rate-mbit R|none] [--loss PCT] [--burst-loss E,X|none] [--queue-ms MS]"),
    }
}

/// `set` changes only the parameters it names.
fn parse_set(current: LinkParams, words: &[&str]) -> anyhow::Result<LinkParams> {
    #[derive(Parser)]
    #[command(no_binary_name = true)]
    struct Set {
        #[arg(long = "delay-ms")]
        delay_ms: Option<f64>,
        #[arg(long = "rate-mbit")]
        rate_mbit: Option<String>,
        #[arg(long = "loss")]
        loss_percent: Option<f64>,
        #[arg(long = "burst-loss")]
        burst_loss: Option<String>,
        #[arg(long = "queue-ms")]
        queue_ms: Option<f64>,
    }
    let set = Set::try_parse_from(words).map_err(|e| anyhow::anyhow!("{}", e.to_string().trim()))?;
    let mut params = current;
    if let Some(v) = set.delay_ms {
        params.delay_ms_one_way = v;
    }
    if let Some(v) = set.rate_mbit {
        params.rate_mbit = parse_rate(&v).map_err(anyhow::Error::msg)?;
    }
    if let Some(v) = set.loss_percent {
        params.loss_percent = v;
    }
    if let Some(v) = set.burst_loss {
        params.burst_loss = if v == "none" { None } else { Some(parse_burst(&v).map_err(anyhow::Error::msg)?) };
    }
    if let Some(v) = set.queue_ms {
        params.queue_ms_max = v;
    }
    params.validate()?;
    Ok(params)
}

fn run_measure(args: &LinkArgs) -> anyhow::Result<()> {
    let options = MeasureOptions {
        samples: args.samples.max(1),
        bulk: Duration::from_secs_f64(args.bulk_seconds.max(0.0)),
        warmup: Duration::from_secs_f64((args.bulk_seconds / 5.0).clamp(0.0, 1.0)),
        ..MeasureOptions::default()
    };
    let stop = sys::catch_stop_signals();
    let mut reports: Vec<Report> = Vec::new();
    if !args.json {
        println!("{}", Report::header());
    }
    for params in args.params.all() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let report = if args.netns {
            let end_a = if args.root_end { EndA::RootNamespace } else { EndA::Namespace };
            let link = Link::create(LinkSpec { params, end_a, seed: args.seed }).context("creating the link")?;
            measure::measure_link(&link, &options)?
        } else {
            measure::measure_proxy(params, &options)?
        };
        if !args.json {
            println!("{}", report.row());
        }
        reports.push(report);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else if let Some(report) = reports.first() {
        println!("congestion control: {}; one-way = half the round trip of {}-byte messages; load p50 = the same during the bulk transfer", report.congestion_control, 64);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        link: LinkArgs,
    }

    fn parse(line: &str) -> Result<LinkArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("link").chain(line.split_whitespace())).map(|c| c.link)
    }

    #[test]
    fn command_lines() {
        let args = parse("--delay-ms 8 --rate-mbit 124 --loss 0.1 --listen 127.0.0.1:9000 --target 127.0.0.1:7103")
            .expect("valid");
        let params = args.params.single().expect("one");
        assert_eq!((params.delay_ms_one_way, params.rate_mbit, params.loss_percent), (8.0, Some(124.0), 0.1));
        assert!(parse("--listen 127.0.0.1:9000").is_err(), "--listen needs --target");
        assert!(parse("--listen 127.0.0.1:9000 --target 127.0.0.1:1 --netns").is_err());
        assert!(parse("--root-end").is_err(), "--root-end needs --netns");
        let args = parse("--measure --delay-ms 1 --delay-ms 8 --rate-mbit 31 --rate-mbit none").expect("valid");
        let all: Vec<_> = args.params.all().iter().map(|p| (p.delay_ms_one_way, p.rate_mbit)).collect();
        assert_eq!(all, [(1.0, Some(31.0)), (8.0, Some(31.0)), (1.0, None), (8.0, None)]);
        let args = parse("--netns --burst-loss 0.01,0.25").expect("valid");
        assert_eq!(args.params.burst_loss, Some(BurstLoss { p_enter: 0.01, p_exit: 0.25 }));
    }

    #[test]
    #[rustfmt::skip]
    fn set_changes_only_what_it_names() {
        let current = LinkParams { delay_ms_one_way: 8.0, rate_mbit: Some(124.0), ..LinkParams::default() };
        let burst = Some(BurstLoss { p_enter: 0.1, p_exit: 0.5 });
        let table: [(&str, LinkParams); 4] = [
            ("--delay-ms 30",                 LinkParams { delay_ms_one_way: 30.0, ..current }),
            ("--rate-mbit none",              LinkParams { rate_mbit: None, ..current }),
            ("--loss 1 --burst-loss 0.1,0.5", LinkParams { loss_percent: 1.0, burst_loss: burst, ..current }),
            ("--queue-ms 10",                 LinkParams { queue_ms_max: 10.0, ..current }),
        ];
        for (line, expected) in table {
            let words: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(parse_set(current, &words).expect(line), expected, "{line}");
        }
        assert!(parse_set(current, &["--loss", "150"]).is_err());
    }
}
