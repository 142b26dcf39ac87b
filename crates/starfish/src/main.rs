//! `starfish`: the one binary. Subcommands run an element, a host element, the demo cluster,
//! print status, and compute availability.

mod bench;
mod config;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use shell::element::ElementOptions;
use shell::host::HostOptions;
use store::StoreOptions;

use crate::config::{parse_size, HostFile};

#[derive(Parser, Debug)]
#[command(name = "starfish", version, about = "Highly-available, geographically replicated block storage over NBD")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start-up: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Run a storage element (or check a stopped element's data: `element verify`).
    Element(ElementArgs),
    /// Run the host element: export volumes over NBD, replicate writes to the elements.
    Host(HostArgs),
    /// Show a host element's state.
    Status(StatusArgs),
    /// Make a standby host element take over (a graceful handover if the active one answers).
    Failover(FailoverArgs),
    /// Start three elements behind emulated local/near/far links and a host element.
    Demo(DemoArgs),
    /// Availability of a configuration (the StarFish paper's section 4).
    Availability(availability::cli::AvailabilityArgs),
    /// Emulate a WAN link (delay, rate, loss, cut/heal): a TCP proxy or network namespaces.
    Link(netem::cli::LinkArgs),
    /// Reproduce the paper's Tables 5–7 with real processes, emulated links and baselines.
    Bench(bench::BenchArgs),
}

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
struct ElementArgs {
    #[command(subcommand)]
    action: Option<ElementAction>,
    /// Address to listen on for the host element (and, later, peers).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Data directory (created if missing).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Bytes of recent writes to keep on disk for peers' replay recovery (e.g. 256MiB).
    #[arg(long, value_parser = parse_size)]
    replay_log: Option<u64>,
    /// Accept volumes whose sizes add up to more than the disk holds (thin provisioning;
    /// writes fail with "no space left" when it fills). Default: such a volume is refused.
    #[arg(long)]
    overcommit: bool,
}

#[derive(Subcommand, Debug)]
enum ElementAction {
    /// Check every block's checksum in a stopped element's data directory and print a content
    /// digest per volume (equal digests = byte-identical replicas).
    Verify {
        #[arg(long)]
        data: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Make a stopped element whose log is damaged start again: keep what is intact, drop the
    /// damaged part, and have every volume that may have lost acknowledged records repaired
    /// from its peers (a full recovery that verifies every block) once the element runs.
    Repair {
        #[arg(long)]
        data: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug)]
struct HostArgs {
    /// TOML file with the same settings as the flags (flags win).
    #[arg(long)]
    config: Option<PathBuf>,
    /// NBD listen address.
    #[arg(long)]
    nbd: Option<SocketAddr>,
    /// Admin (status, metrics) listen address.
    #[arg(long)]
    admin: Option<SocketAddr>,
    /// An element as NAME=ADDRESS, e.g. near=127.0.0.1:7102 (repeatable).
    #[arg(long = "element")]
    elements: Vec<String>,
    /// Write quorum: elements that must hold a write before the host is answered.
    #[arg(long)]
    quorum: Option<usize>,
    /// A volume as NAME:SIZE, e.g. vol0:1GiB (repeatable).
    #[arg(long = "volume")]
    volumes: Vec<String>,
    /// Write queue size per volume (e.g. 128MiB).
    #[arg(long, value_parser = parse_size)]
    write_queue: Option<u64>,
    /// Read cache size (e.g. 256MiB; 0 turns it off).
    #[arg(long, value_parser = parse_size)]
    read_cache: Option<u64>,
    /// Recovery pace per recovering volume in bytes per second (e.g. 100MiB); default unlimited.
    #[arg(long, value_parser = parse_size)]
    recovery_rate: Option<u64>,
    /// How long requests that arrive before enough elements answered are held; then they fail
    /// with EIO until the elements answer (default 10000).
    #[arg(long)]
    startup_timeout_ms: Option<u64>,
    /// Start as a standby: connect to nothing and serve nothing until `starfish failover`
    /// (or, with --etcd, until elected and the elements lost the active host element).
    #[arg(long)]
    standby: bool,
    /// etcd endpoint (e.g. http://127.0.0.1:2379): host elements of one cluster elect the
    /// active one, and a standby takes over by itself.
    #[arg(long)]
    etcd: Option<String>,
    /// The cluster's name in etcd (default starfish).
    #[arg(long)]
    cluster: Option<String>,
    /// With --etcd: how long the elements must have missed the active host element before a
    /// standby takes over (default 300).
    #[arg(long)]
    takeover_after_ms: Option<u64>,
}

#[derive(Args, Debug)]
struct FailoverArgs {
    /// Admin address of the standby host element that takes over (it asks the active one to
    /// drain first, if that one answers).
    #[arg(long)]
    admin: SocketAddr,
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct StatusArgs {
    #[arg(long, default_value = "127.0.0.1:7100")]
    admin: SocketAddr,
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct DemoArgs {
    /// Stop by itself after this many seconds (default: serve until Ctrl-C).
    #[arg(long)]
    duration: Option<u64>,
    #[arg(long, default_value = "127.0.0.1:10809")]
    nbd: SocketAddr,
    #[arg(long, default_value = "127.0.0.1:7100")]
    admin: SocketAddr,
    /// First element port; elements use this and the next two.
    #[arg(long, default_value_t = 7101)]
    element_port: u16,
    /// Data directory (default: a fresh temporary directory, removed at exit).
    #[arg(long)]
    data: Option<PathBuf>,
    #[arg(long, default_value = "vol0:1GiB")]
    volume: String,
}

fn main() {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    if let Err(e) = run(cli) {
        eprintln!("starfish: error: {e:#}");
        std::process::exit(1);
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the runtime")
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Element(args) => match args.action {
            Some(ElementAction::Verify { data, json }) => verify(&data, json),
            Some(ElementAction::Repair { data, json }) => repair(&data, json),
            None => {
                let listen = args.listen.context("--listen ADDRESS is required")?;
                let data = args.data.context("--data DIR is required")?;
                let mut store = StoreOptions::default();
                if let Some(bytes) = args.replay_log {
                    store.replay_log_bytes = bytes;
                }
                store.overcommit = args.overcommit;
                runtime()?.block_on(async {
                    shell::element::run(ElementOptions { listen, data, store }, shutdown_signal()).await?;
                    Ok(())
                })
            }
        },
        Command::Host(args) => {
            let options = host_options(args)?;
            runtime()?.block_on(async {
                shell::host::start(options).await?;
                shutdown_signal().await;
                tracing::info!("host element stopping");
                Ok(())
            })
        }
        Command::Status(args) => status(args),
        Command::Failover(args) => failover(args),
        Command::Demo(args) => demo(args),
        Command::Availability(args) => availability::cli::run(&args, &mut std::io::stdout()),
        Command::Link(args) => netem::cli::run(&args),
        Command::Bench(args) => bench::run(args),
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

fn host_options(args: HostArgs) -> Result<HostOptions> {
    let mut file = match &args.config {
        Some(path) => HostFile::load(path)?,
        None => HostFile::default(),
    };
    if let Some(nbd) = args.nbd {
        file.nbd = Some(nbd);
    }
    if let Some(admin) = args.admin {
        file.admin = Some(admin);
    }
    if !args.elements.is_empty() {
        file.element = args.elements.iter().map(|s| config::parse_element(s)).collect::<Result<_>>()?;
    }
    if !args.volumes.is_empty() {
        file.volume = args.volumes.iter().map(|s| config::parse_volume(s)).collect::<Result<_>>()?;
    }
    if let Some(q) = args.quorum {
        file.quorum = Some(q);
    }
    if let Some(b) = args.write_queue {
        file.write_queue = Some(b.to_string());
    }
    if let Some(b) = args.read_cache {
        file.read_cache = Some(b.to_string());
    }
    if let Some(b) = args.recovery_rate {
        file.recovery_rate = Some(b.to_string());
    }
    if let Some(ms) = args.startup_timeout_ms {
        file.startup_timeout_ms = Some(ms);
    }
    if args.standby {
        file.standby = Some(true);
    }
    if args.etcd.is_some() {
        file.etcd = args.etcd;
    }
    if args.cluster.is_some() {
        file.cluster = args.cluster;
    }
    if let Some(ms) = args.takeover_after_ms {
        file.takeover_after_ms = Some(ms);
    }
    file.into_options()
}

fn repair(data: &std::path::Path, json: bool) -> Result<()> {
    if !data.exists() {
        bail!("data directory {} does not exist", data.display());
    }
    let report = store::Store::repair(data, StoreOptions::default())
        .map_err(|e| anyhow::anyhow!("cannot repair {}: {e}", data.display()))?;
    if json {
        let doc = serde_json::json!({ "actions": report.actions, "volumes_to_repair": report.volumes_to_repair });
        println!("{doc}");
        return Ok(());
    }
    if report.actions.is_empty() {
        println!("{}: opens as it is; nothing to repair", data.display());
    }
    for action in &report.actions {
        println!("{action}");
    }
    if !report.volumes_to_repair.is_empty() {
        println!(
            "volumes to be repaired from their peers when the element runs: {}",
            report.volumes_to_repair.join(", ")
        );
    }
    Ok(())
}

fn verify(data: &std::path::Path, json: bool) -> Result<()> {
    if !data.exists() {
        bail!("data directory {} does not exist", data.display());
    }
    let volumes = shell::element::verify(data).map_err(|e| anyhow::anyhow!("{}: {e}", data.display()))?;
    if json {
        let doc = serde_json::json!({
            "volumes": volumes.iter().map(|(name, size, applied, digest)| serde_json::json!({
                "name": name, "size_bytes": size, "applied_sequence": applied.0, "digest": digest,
            })).collect::<Vec<_>>(),
        });
        println!("{doc}");
    } else {
        for (name, size, applied, digest) in volumes {
            println!("{name}\tsize={size}\tapplied_sequence={applied}\tdigest={digest}\tchecksums=ok");
        }
    }
    Ok(())
}

fn status(args: StatusArgs) -> Result<()> {
    let body = runtime()?
        .block_on(shell::admin::get(args.admin, "/status"))
        .with_context(|| format!("cannot reach the host element's admin endpoint at {}", args.admin))?;
    if args.json {
        println!("{body}");
        return Ok(());
    }
    let doc: serde_json::Value = serde_json::from_str(&body).context("admin endpoint sent bad JSON")?;
    print_status(&doc);
    Ok(())
}

fn failover(args: FailoverArgs) -> Result<()> {
    let body = runtime()?
        .block_on(shell::admin::request(args.admin, "POST", "/failover"))
        .with_context(|| format!("the host element at {} did not take over", args.admin))?;
    if args.json {
        println!("{body}");
        return Ok(());
    }
    let doc: serde_json::Value = serde_json::from_str(&body).context("admin endpoint sent bad JSON")?;
    let drained = match doc["drained"].get("ok") {
        Some(serde_json::Value::Bool(true)) => {
            format!("; {} drained first", doc["drained"]["from"].as_str().unwrap_or("?"))
        }
        Some(_) => format!(
            "; {} could not drain ({}), fenced instead",
            doc["drained"]["from"].as_str().unwrap_or("?"),
            doc["drained"]["error"].as_str().unwrap_or("?")
        ),
        None => String::new(),
    };
    let ready = match doc["ready_ms"].as_u64() {
        Some(ms) => format!("every volume read-write after {ms} ms"),
        None => "volumes not read-write yet (see starfish status)".into(),
    };
    println!("{} is active in epoch {}: {ready}{drained}", args.admin, doc["epoch"]);
    Ok(())
}

fn print_status(doc: &serde_json::Value) {
    if doc["role"] == "standby" {
        let active = match doc["active"].as_object() {
            Some(a) => format!("{} at {}", a["host_id"].as_str().unwrap_or("?"), a["admin"].as_str().unwrap_or("?")),
            None => "none known".into(),
        };
        println!(
            "standby (host element {})  elements follow epoch {}  active: {active}",
            doc["host_id"].as_str().unwrap_or("?"),
            doc["epoch"]
        );
        println!("{:<10} {:<22} {:>8} {:>18} {:>12}", "ELEMENT", "ADDRESS", "EPOCH", "HOLDER", "ABSENT ms");
        for e in doc["elements"].as_array().into_iter().flatten() {
            if e["reachable"] == true {
                println!(
                    "{:<10} {:<22} {:>8} {:>18} {:>12}",
                    e["name"].as_str().unwrap_or("?"),
                    e["address"].as_str().unwrap_or("?"),
                    e["epoch"],
                    e["holder"].as_str().unwrap_or("?"),
                    e["owner_absent_ms"]
                );
            } else {
                println!(
                    "{:<10} {:<22} unreachable",
                    e["name"].as_str().unwrap_or("?"),
                    e["address"].as_str().unwrap_or("?")
                );
            }
        }
        return;
    }
    println!(
        "{} (host element {})  epoch {}  quorum {}",
        doc["role"].as_str().unwrap_or("active"),
        doc["host_id"].as_str().unwrap_or("?"),
        doc["epoch"],
        doc["quorum"]
    );
    println!("{:<12} {:>14} {:<11} {:>14} {:>12}", "VOLUME", "SIZE", "MODE", "ACKED SEQ", "QUEUE");
    for v in doc["volumes"].as_array().into_iter().flatten() {
        println!(
            "{:<12} {:>14} {:<11} {:>14} {:>11.1}%",
            v["name"].as_str().unwrap_or("?"),
            config::format_size(v["size_bytes"].as_u64().unwrap_or(0)),
            v["mode"].as_str().unwrap_or("?"),
            v["acked_sequence"],
            100.0 * v["write_queue_used_bytes"].as_f64().unwrap_or(0.0)
                / v["write_queue_capacity_bytes"].as_f64().unwrap_or(1.0).max(1.0),
        );
    }
    println!("{:<10} {:<22} {:<11} {:>8} {:>9}  DETAIL", "ELEMENT", "ADDRESS", "STATE", "LAG", "RTT ms");
    for e in doc["elements"].as_array().into_iter().flatten() {
        let detail = if let Some(r) = e.get("recovery") {
            let kind = r["kind"].as_str().unwrap_or("?");
            let source = r["source"].as_str().unwrap_or("?");
            if r["phase"] == "copy" {
                let (done, total) = (r["done_bytes"].as_u64().unwrap_or(0), r["total_bytes"].as_u64().unwrap_or(0));
                format!(
                    "{kind} recovery from {source}: copy {}/{} ({:.0}%), {} sent, ETA {}",
                    config::format_size(done),
                    config::format_size(total),
                    100.0 * done as f64 / total.max(1) as f64,
                    config::format_size(r["copied_bytes"].as_u64().unwrap_or(0)),
                    r["eta_seconds"].as_f64().map_or("?".to_string(), |s| format!("{s:.0}s")),
                )
            } else {
                format!(
                    "{kind} recovery from {source}: {}/{} writes, ETA {}",
                    r["done_records"],
                    r["total_records"],
                    r["eta_seconds"].as_f64().map_or("?".to_string(), |s| format!("{s:.0}s")),
                )
            }
        } else if let Some(reason) = e["reason"].as_str() {
            reason.to_string()
        } else if let Some(r) = e.get("last_recovery") {
            let copied = r["copied_bytes"].as_u64().unwrap_or(0);
            let copied = if copied > 0 { format!(", {} copied", config::format_size(copied)) } else { String::new() };
            format!(
                "last recovery: {} {} writes{copied} in {:.2}s",
                r["kind"].as_str().unwrap_or("?"),
                r["records"],
                r["seconds"].as_f64().unwrap_or(0.0)
            )
        } else {
            String::new()
        };
        let rtt = e["rtt_ms"].as_f64().map_or("-".to_string(), |ms| format!("{ms:.2}"));
        println!(
            "{:<10} {:<22} {:<11} {:>8} {:>9}  {}",
            e["name"].as_str().unwrap_or("?"),
            e["address"].as_str().unwrap_or("?"),
            e["state"].as_str().unwrap_or("?"),
            e["lag"],
            rtt,
            detail
        );
    }
}

fn demo(args: DemoArgs) -> Result<()> {
    let (data, temporary) = match &args.data {
        Some(dir) => (dir.clone(), false),
        None => {
            let dir = std::env::temp_dir().join(format!("starfish-demo-{}", std::process::id()));
            (dir, true)
        }
    };
    let volume = config::parse_volume(&args.volume)?;
    let result = runtime()?.block_on(async {
        // (name, one-way delay) of the three sites, as in the paper's setting.
        let sites = [("local", 0u64), ("near", 1), ("far", 8)];
        let mut elements = Vec::new();
        let mut links = Vec::new();
        for (i, (name, delay_ms)) in sites.iter().enumerate() {
            let port = args.element_port + i as u16;
            let listen: SocketAddr = format!("127.0.0.1:{port}").parse().expect("valid address");
            let options = ElementOptions { listen, data: data.join(name), store: StoreOptions::default() };
            tokio::spawn(async move {
                if let Err(e) = shell::element::run(options, std::future::pending()).await {
                    tracing::error!(error = %e, "demo element stopped");
                }
            });
            let address = if *delay_ms == 0 {
                listen
            } else {
                let any: SocketAddr = "127.0.0.1:0".parse().expect("valid address");
                let params = netem::LinkParams { delay_ms_one_way: *delay_ms as f64, ..netem::LinkParams::default() };
                let proxy =
                    netem::Proxy::start(any, listen, params).with_context(|| format!("emulated {name} link"))?;
                let address = proxy.address();
                links.push(proxy);
                address
            };
            elements.push(config::ElementEntry { name: name.to_string(), address });
        }
        let file = HostFile {
            nbd: Some(args.nbd),
            admin: Some(args.admin),
            quorum: Some(2),
            element: elements,
            volume: vec![volume.clone()],
            ..HostFile::default()
        };
        let options = file.into_options()?;
        let host = shell::host::start(options).await?;
        let uri = format!("nbd://{}/{}", args.nbd, volume.name);
        println!("StarFish demo: 3 elements (local 0 ms, near 1 ms, far 8 ms one-way), write quorum 2");
        println!("data directory: {}", data.display());
        println!("volume {} ({}) exported at: {uri}", volume.name, volume.size);
        println!();
        println!("Use it from a host:");
        println!("  nbdinfo {uri}");
        println!("  qemu-io -f raw -c 'write -P 0xab 0 1M' -c 'read -P 0xab 0 1M' {uri}");
        println!(
            "  nbd-client -N {} {} {} /dev/nbd0     # Linux kernel client",
            volume.name,
            args.nbd.ip(),
            args.nbd.port()
        );
        println!("  nbdfuse /tmp/sf/disk {uri} &  then  mkfs.ext4 /tmp/sf/disk  (or losetup + mount)");
        println!("  starfish status --admin {}", args.admin);
        println!();
        let deadline = args.duration.map(|s| tokio::time::Instant::now() + Duration::from_secs(s));
        let period = Duration::from_secs(5);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        loop {
            let stop = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tick.tick() => {
                    if let Some(doc) = host.status_json().await {
                        print_status(&doc);
                        println!();
                    }
                }
                _ = stop => break,
                _ = shutdown_signal() => break,
            }
        }
        println!("demo stopping");
        Ok::<(), anyhow::Error>(())
    });
    if temporary {
        let _ = std::fs::remove_dir_all(&data);
    }
    result
}
