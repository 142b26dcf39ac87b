//! `starfish`: the one binary. Subcommands run an element, a host element, the demo cluster,
//! print status, and compute availability.

mod bench;
mod config;
mod memory;

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
    /// How log lines are written to stderr: `text` (coloured only on a terminal, and never
    /// with NO_COLOR set) or `json` (one object per line, for log collectors).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
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
    Status(AdminTarget),
    /// Make a standby host element take over (a graceful handover if the active one answers).
    Failover(FailoverArgs),
    /// Compare a volume's replicas block by block and repair an element that differs.
    Scrub(ScrubArgs),
    /// Create, delete and list volumes while the cluster runs.
    Volume(VolumeArgs),
    /// Take, delete and list snapshots of volumes while the cluster runs.
    Snapshot(SnapshotArgs),
    /// Make a cluster CA and the certificates of its processes and operators (mutual TLS).
    Certs(CertsArgs),
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
    /// TOML file with the same settings as the flags (flags win).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Address to listen on for host elements and peers.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Data directory (created if missing).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Bytes of recent writes to keep on disk for peers' replay recovery (e.g. 256MiB).
    #[arg(long, value_parser = parse_size)]
    replay_log: Option<u64>,
    /// Log bytes after which the live log segment is sealed and checkpointed in the background
    /// (default 64MiB, 64KiB to 4GiB): a crash replays at most about four
    /// times this; smaller means more frequent checkpoints.
    #[arg(long, value_parser = parse_size)]
    checkpoint_log: Option<u64>,
    /// Accept volumes whose sizes add up to more than the disk holds (thin provisioning;
    /// writes fail with "no space left" when it fills). Default: such a volume is refused.
    #[arg(long)]
    overcommit: bool,
    /// Write large writes into holes once (a volume's first fill: up to about twice as fast,
    /// half the disk bytes), at a cost: small writes beside them wait longer on a disk, and
    /// writing such a write's blocks again soon after first copies their data into the log
    /// (for lagging peers' replay).
    #[arg(long)]
    placed_writes: bool,
    /// Directory with the cluster CA and this element's certificate and key (`starfish certs
    /// init`): only host elements and elements of the cluster are served, peers over TLS.
    #[arg(long)]
    tls_dir: Option<PathBuf>,
    /// Serve plain TCP on an address beyond loopback (only on a network protected otherwise).
    #[arg(long)]
    insecure: bool,
    /// Do not listen on the local socket (on a loopback address, host elements and elements on
    /// this machine reach the element over a Unix socket named after it: about a quarter
    /// cheaper a round trip than loopback TCP).
    #[arg(long)]
    no_local_socket: bool,
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
    /// An element as NAME=ADDRESS[,ack=POLICY][,fec=R:C][,rate=RATE], e.g.
    /// near=127.0.0.1:7102 or far=10.0.0.3:7103,ack=network-sync,fec=8:3,rate=100Mbit
    /// (repeatable). fec= reaches it over the far link: UDP with R data and C repair packets
    /// per group, paced to rate=.
    #[arg(long = "element")]
    elements: Vec<String>,
    /// Write quorum: elements that must hold a write before the host is answered.
    #[arg(long)]
    quorum: Option<usize>,
    /// A volume as NAME:SIZE, e.g. vol0:1GiB (repeatable).
    #[arg(long = "volume")]
    volumes: Vec<String>,
    /// A consistency group as NAME:VOLUME,VOLUME…, e.g. db:data,wal (repeatable): its volumes
    /// share one sequence space, so every element (the far one included) applies their writes
    /// in one order and holds a crash-consistent copy of all of them. A volume in no group is
    /// its own.
    #[arg(long = "group")]
    groups: Vec<String>,
    /// Write queue size per volume (e.g. 128MiB).
    #[arg(long, value_parser = parse_size)]
    write_queue: Option<u64>,
    /// Read cache size (e.g. 256MiB; 0 turns it off).
    #[arg(long, value_parser = parse_size)]
    read_cache: Option<u64>,
    /// Recovery pace per recovering volume in bytes per second (e.g. 100MiB); default unlimited.
    #[arg(long, value_parser = parse_size)]
    recovery_rate: Option<u64>,
    /// Scrub every volume this often in the background, e.g. 7d, 12h; 0 turns it off
    /// (default 7d).
    #[arg(long)]
    scrub_interval: Option<String>,
    /// Pace of scrubs in bytes per second, e.g. 32MiB (default; 0: unlimited).
    #[arg(long, value_parser = parse_size)]
    scrub_rate: Option<u64>,
    /// When intentions of volume operations (`starfish volume create`) are written durably:
    /// group (Slice's GROUP-COMMIT, the default: up to 10 ms or 5 intentions share one
    /// write), single (one write each) or none (no intention log: a crash mid-way can leave a
    /// volume no catalog names).
    #[arg(long, value_parser = ["group", "single", "none"])]
    intention_log: Option<String>,
    /// How long requests that arrive before enough elements answered are held; then they fail
    /// with EIO until the elements answer (default 10000).
    #[arg(long)]
    startup_timeout_ms: Option<u64>,
    /// How long an NBD client may stop sending in the middle of a request, or leave a reply
    /// untaken, before its connection is closed and what it held is freed: 1s to 1h (default
    /// 30s).
    #[arg(long)]
    nbd_stall_timeout: Option<String>,
    /// How long an element may send nothing (no answer to the 100 ms heartbeats, no reply)
    /// before it is failed: 1s to 10min (default 3s). A lagging element is failed sooner when
    /// it fills the write queue.
    #[arg(long)]
    heartbeat_timeout: Option<String>,
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
    /// Directory with the cluster CA and this host element's certificate and key: mutual TLS
    /// toward the elements, NBD over TLS only (STARTTLS), admin orders by certificate.
    #[arg(long)]
    tls_dir: Option<PathBuf>,
    /// With --tls-dir: NBD clients must present a certificate of the cluster CA (admin or
    /// client role).
    #[arg(long)]
    nbd_tls_verify_peer: bool,
    /// Serve plain TCP on addresses beyond loopback (only on a network protected otherwise).
    #[arg(long)]
    insecure: bool,
    /// Reach elements at loopback addresses over TCP only, never over their local socket.
    #[arg(long)]
    no_local_socket: bool,
}

#[derive(Args, Debug)]
struct CertsArgs {
    #[command(subcommand)]
    action: CertsAction,
}

#[derive(Subcommand, Debug)]
enum CertsAction {
    /// A new CA in DIR/ca and a certificate for every name, each in DIR/NAME (what --tls-dir
    /// takes). Refuses if DIR/ca exists.
    Init(CertsNames),
    /// More certificates, signed by the CA in DIR/ca.
    Add(CertsNames),
}

#[derive(Args, Debug)]
struct CertsNames {
    dir: PathBuf,
    /// Host elements: NAME, or NAME=ALT,ALT… with the names and addresses NBD clients reach it
    /// at (localhost, 127.0.0.1 and ::1 are always included).
    #[arg(long = "host", num_args = 1..)]
    hosts: Vec<String>,
    /// Storage elements: NAME or NAME=ALT,ALT…
    #[arg(long = "element", num_args = 1..)]
    elements: Vec<String>,
    /// Operators (admin role: admin orders and NBD), with the file names qemu and libnbd expect.
    #[arg(long = "client", num_args = 1..)]
    clients: Vec<String>,
    /// NBD hosts that may only read and write volumes (client role).
    #[arg(long = "nbd-client", num_args = 1..)]
    nbd_clients: Vec<String>,
    /// Days the certificates stay valid (default 825).
    #[arg(long, conflicts_with = "not_after")]
    days: Option<i64>,
    /// Last day the certificates are valid, YYYY-MM-DD (UTC).
    #[arg(long)]
    not_after: Option<String>,
}

#[derive(Args, Debug)]
struct FailoverArgs {
    /// Admin address of the standby host element that takes over (it asks the active one to
    /// drain first, if that one answers).
    #[arg(long)]
    admin: SocketAddr,
    #[arg(long)]
    json: bool,
    /// A TLS directory with an admin certificate (needed when the cluster uses TLS).
    #[arg(long)]
    tls_dir: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct ScrubArgs {
    /// The volume to scrub.
    volume: String,
    /// Admin address of the active host element.
    #[arg(long, default_value = "127.0.0.1:7100")]
    admin: SocketAddr,
    /// Pace in bytes per second, e.g. 64MiB; 0: unlimited (default: the host element's
    /// --scrub-rate).
    #[arg(long, value_parser = parse_size)]
    rate: Option<u64>,
    /// Start it and return at once (progress is in `starfish status`).
    #[arg(long)]
    no_wait: bool,
    /// Print the final report as JSON.
    #[arg(long)]
    json: bool,
    /// A TLS directory with an admin certificate (needed when the cluster uses TLS).
    #[arg(long)]
    tls_dir: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct VolumeArgs {
    #[command(subcommand)]
    action: VolumeAction,
}

#[derive(Subcommand, Debug)]
enum VolumeAction {
    /// Create a volume on every element and export it over NBD at once; it survives restarts
    /// of every process. Failure-atomic: a crash mid-way leaves it created everywhere or
    /// nowhere.
    Create(VolumeCreateArgs),
    /// Delete a volume created while running: it stops being exported at once and its space is
    /// freed on every element (one that is down frees it when it comes back). Refused while an
    /// NBD client is connected to it. Failure-atomic, as creation.
    Delete(VolumeDeleteArgs),
    /// Grow a volume created while running, on every element (one that is down grows it when
    /// it comes back); NBD clients that connect from then on see the new size, the new blocks
    /// read as zeroes. Allowed while the volume is in use. Failure-atomic, as creation.
    Resize(VolumeResizeArgs),
    /// Create a volume as a clone of a snapshot (VOLUME@NAME): a writable volume of the
    /// snapshot's size that starts with its content and shares, on every element, the blocks
    /// it has not written. It can be snapshotted and cloned in turn; the snapshot cannot be
    /// deleted while it has clones. Failure-atomic, as creation.
    Clone(VolumeCloneArgs),
    /// List the volumes served: configured ones and those created while running.
    List(VolumeListArgs),
}

#[derive(Args, Debug)]
struct VolumeCloneArgs {
    /// The snapshot to clone, VOLUME@NAME (see starfish snapshot list).
    snapshot: String,
    /// The new volume's name: letters, digits, '.', '_' and '-'.
    name: String,
    #[command(flatten)]
    target: AdminTarget,
}

#[derive(Args, Debug)]
struct VolumeDeleteArgs {
    /// The volume's name.
    name: String,
    /// Delete its snapshots with it (a volume with snapshots is refused otherwise).
    #[arg(long)]
    with_snapshots: bool,
    #[command(flatten)]
    target: AdminTarget,
}

#[derive(Args, Debug)]
struct SnapshotArgs {
    #[command(subcommand)]
    action: SnapshotAction,
}

#[derive(Subcommand, Debug)]
enum SnapshotAction {
    /// Take a snapshot: the volume's content at one point of its ordered stream, the same on
    /// every element, exported read-only over NBD as VOLUME@NAME. It costs space only for the
    /// blocks written after it. Failure-atomic through the intention log.
    Create(SnapshotCreateArgs),
    /// Delete a snapshot (VOLUME@NAME): its export goes at once, its blocks on every element
    /// (one that is down deletes it when it catches up). Refused while an NBD client reads it.
    Delete(SnapshotDeleteArgs),
    /// List the snapshots.
    List(SnapshotListArgs),
}

#[derive(Args, Debug)]
struct SnapshotCreateArgs {
    /// VOLUME NAME: the volume to take it of, and its name (letters, digits, '.', '_' and
    /// '-'; exported as VOLUME@NAME). With --group, NAME alone.
    #[arg(num_args = 1..=2, required = true, value_names = ["VOLUME", "NAME"])]
    args: Vec<String>,
    /// Take it of this consistency group: all its volumes at one point of its one stream
    /// (crash-consistent as a whole); each member M is exported read-only as M@NAME.
    #[arg(long)]
    group: Option<String>,
    #[command(flatten)]
    target: AdminTarget,
}

#[derive(Args, Debug)]
struct SnapshotDeleteArgs {
    /// VOLUME@NAME.
    snapshot: String,
    #[command(flatten)]
    target: AdminTarget,
}

#[derive(Args, Debug)]
struct SnapshotListArgs {
    #[command(flatten)]
    target: AdminTarget,
}

#[derive(Args, Debug)]
struct VolumeCreateArgs {
    /// Name: letters, digits, '.', '_' and '-' (up to 200 bytes, not starting with '.').
    name: String,
    /// Size, e.g. 10GiB: a positive multiple of 4096 bytes.
    #[arg(value_parser = parse_size)]
    size: u64,
    /// A consistency group to join: the volume's writes then share the group's one order,
    /// and the group's snapshots taken from now on include it.
    #[arg(long)]
    group: Option<String>,
    #[command(flatten)]
    target: AdminTarget,
}

#[derive(Args, Debug)]
struct VolumeResizeArgs {
    /// The volume's name.
    name: String,
    /// New size, e.g. 20GiB: a multiple of 4096 bytes; smaller than the volume only with
    /// --shrink.
    #[arg(value_parser = parse_size)]
    size: u64,
    /// Shrink the volume: what lies past the new size is lost (zeroed on every element).
    /// Refused while NBD clients use the volume.
    #[arg(long)]
    shrink: bool,
    #[command(flatten)]
    target: AdminTarget,
}

#[derive(Args, Debug)]
struct VolumeListArgs {
    #[command(flatten)]
    target: AdminTarget,
}

/// Which host element an operator command goes to, and how it answers.
#[derive(Args, Debug)]
struct AdminTarget {
    /// Admin address of the active host element.
    #[arg(long, default_value = "127.0.0.1:7100")]
    admin: SocketAddr,
    #[arg(long)]
    json: bool,
    /// A TLS directory with an admin certificate (needed when the cluster uses TLS).
    #[arg(long)]
    tls_dir: Option<PathBuf>,
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
    /// Plain TCP everywhere (default: mutual TLS between the processes and NBD over TLS, with
    /// certificates made in DATA/tls).
    #[arg(long)]
    no_tls: bool,
}

/// The demo's certificates in `dir` (made on the first run): its host element, its three
/// elements, and an operator ("admin") whose directory NBD clients and `starfish` use.
fn demo_certificates(dir: &std::path::Path, elements: &[&str]) -> Result<()> {
    use shell::tls::certs::{Subject, Validity};
    use shell::tls::Role;
    if dir.join("ca").exists() {
        return Ok(());
    }
    let mut subjects = vec![Subject::parse(Role::Host, "demo-host").map_err(anyhow::Error::msg)?];
    for name in elements {
        subjects.push(Subject::parse(Role::Element, name).map_err(anyhow::Error::msg)?);
    }
    subjects.push(Subject::parse(Role::Admin, "admin").map_err(anyhow::Error::msg)?);
    let validity = Validity::days(shell::tls::certs::LEAF_DAYS_DEFAULT);
    shell::tls::certs::init(dir, &subjects, validity).map_err(anyhow::Error::msg)?;
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Json => logs.json().with_current_span(false).init(),
        LogFormat::Text => {
            use std::io::IsTerminal;
            let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
            logs.with_ansi(colour).init()
        }
    }
    if let Err(e) = run(cli) {
        eprintln!("starfish: error: {e:#}");
        std::process::exit(1);
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the runtime")
}

/// An element's runtime: one worker per two cores (at least one), unless `TOKIO_WORKER_THREADS`
/// says otherwise. Its committer, checkpoint, reclaim and read threads, and the kernel's page
/// cache and network work, take the rest; on two cores one worker cost less CPU per write and
/// was level or faster in A/B rounds of every job of the peer suite (docs/benchmarks.md,
/// "elements on one worker per two cores").
fn element_runtime() -> Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        builder.worker_threads(element_workers(std::thread::available_parallelism().map_or(1, |n| n.get())));
    }
    builder.enable_all().build().context("starting the runtime")
}

/// The element's worker threads on a machine of `cores` cores.
fn element_workers(cores: usize) -> usize {
    (cores / 2).max(1)
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Element(args) => match args.action {
            Some(ElementAction::Verify { data, json }) => verify(&data, json),
            Some(ElementAction::Repair { data, json }) => repair(&data, json),
            None => {
                let options = element_options(args)?;
                element_runtime()?.block_on(async {
                    shell::element::run(options, shutdown_signal()).await?;
                    Ok(())
                })
            }
        },
        Command::Host(args) => {
            let options = host_options(args)?;
            runtime()?.block_on(async {
                let node = shell::host::start(options).await?;
                shutdown_signal().await;
                tracing::info!("host element stopping");
                node.stop().await;
                // What far-link sessions have not delivered would die with the process (a TCP
                // socket's buffer does not): let them drain first, briefly.
                let undrained = shell::far_link::drain(FAR_LINK_DRAIN).await;
                if undrained > 0 {
                    tracing::warn!(sessions = undrained, "far-link sessions not drained when stopping");
                }
                Ok(())
            })
        }
        Command::Status(args) => status(args),
        Command::Failover(args) => failover(args),
        Command::Scrub(args) => scrub(args),
        Command::Volume(args) => volume(args),
        Command::Snapshot(args) => snapshot(args),
        Command::Certs(args) => certs(args),
        Command::Demo(args) => demo(args),
        Command::Availability(args) => availability::cli::run(&args, &mut std::io::stdout()),
        Command::Link(args) => netem::cli::run(&args),
        Command::Bench(args) => bench::run(args),
    }
}

/// How long a stopping host element waits for its far-link sessions to deliver what they hold.
const FAR_LINK_DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

fn element_options(args: ElementArgs) -> Result<ElementOptions> {
    let mut file = match &args.config {
        Some(path) => config::ElementFile::load(path)?,
        None => config::ElementFile::default(),
    };
    if args.listen.is_some() {
        file.listen = args.listen;
    }
    if args.data.is_some() {
        file.data = args.data;
    }
    if let Some(bytes) = args.replay_log {
        file.replay_log = Some(bytes.to_string());
    }
    if let Some(bytes) = args.checkpoint_log {
        file.checkpoint_log = Some(bytes.to_string());
    }
    if args.overcommit {
        file.overcommit = Some(true);
    }
    if args.placed_writes {
        file.placed_writes = Some(true);
    }
    if args.tls_dir.is_some() {
        file.tls_dir = args.tls_dir;
    }
    if args.insecure {
        file.insecure = Some(true);
    }
    if args.no_local_socket {
        file.local_socket = Some(false);
    }
    file.into_options()
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
    if !args.groups.is_empty() {
        file.group = args.groups.iter().map(|s| config::parse_group(s)).collect::<Result<_>>()?;
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
    if args.scrub_interval.is_some() {
        file.scrub_interval = args.scrub_interval;
    }
    if let Some(b) = args.scrub_rate {
        file.scrub_rate = Some(b.to_string());
    }
    if args.intention_log.is_some() {
        file.intention_log = args.intention_log;
    }
    if let Some(ms) = args.startup_timeout_ms {
        file.startup_timeout_ms = Some(ms);
    }
    if args.nbd_stall_timeout.is_some() {
        file.nbd_stall_timeout = args.nbd_stall_timeout;
    }
    if args.heartbeat_timeout.is_some() {
        file.heartbeat_timeout = args.heartbeat_timeout;
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
    if args.tls_dir.is_some() {
        file.tls_dir = args.tls_dir;
    }
    if args.nbd_tls_verify_peer {
        file.nbd_tls_verify_peer = Some(true);
    }
    if args.insecure {
        file.insecure = Some(true);
    }
    if args.no_local_socket {
        file.local_socket = Some(false);
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

fn certs(args: CertsArgs) -> Result<()> {
    use shell::tls::certs::{Subject, Validity};
    use shell::tls::Role;
    let (names, init) = match args.action {
        CertsAction::Init(names) => (names, true),
        CertsAction::Add(names) => (names, false),
    };
    let mut subjects = Vec::new();
    for (role, list) in [
        (Role::Host, &names.hosts),
        (Role::Element, &names.elements),
        (Role::Admin, &names.clients),
        (Role::Client, &names.nbd_clients),
    ] {
        for text in list {
            subjects.push(Subject::parse(role, text).map_err(anyhow::Error::msg)?);
        }
    }
    let validity = match (&names.not_after, names.days) {
        (Some(date), _) => Validity::until(date).map_err(anyhow::Error::msg)?,
        (None, days) => Validity::days(days.unwrap_or(shell::tls::certs::LEAF_DAYS_DEFAULT)),
    };
    let made = if init {
        shell::tls::certs::init(&names.dir, &subjects, validity)
    } else {
        shell::tls::certs::add(&names.dir, &subjects, validity)
    }
    .map_err(anyhow::Error::msg)?;
    if init {
        println!("CA: {} (keep ca-key.pem safe; it signs new members)", names.dir.join("ca").display());
    }
    for m in made {
        println!("{:<8} {:<16} --tls-dir {}", m.subject.role.as_str(), m.subject.name, m.directory.display());
    }
    Ok(())
}

fn status(args: AdminTarget) -> Result<()> {
    let tls = config::load_tls(args.tls_dir.as_deref())?;
    let body = runtime()?
        .block_on(shell::admin::get(args.admin, "/status", tls.as_ref()))
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
    let tls = config::load_tls(args.tls_dir.as_deref())?;
    let body = runtime()?
        .block_on(shell::admin::request(args.admin, "POST", "/failover", tls.as_ref()))
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

/// `starfish scrub`: start a scrub, follow it in the status document, report what it found.
/// Exit status as fsck's: 0 the replicas agree, 1 differences were repaired, 4 some were left
/// (no majority, or an element could not scrub; it repairs itself from a peer).
/// The reason in an admin endpoint's refusal (`{"error": …}`), else the whole answer.
fn admin_error(e: std::io::Error) -> anyhow::Error {
    let text = e.to_string();
    let reason = text
        .find('{')
        .and_then(|at| serde_json::from_str::<serde_json::Value>(&text[at..]).ok())
        .and_then(|doc| doc["error"].as_str().map(str::to_string));
    anyhow::anyhow!(reason.unwrap_or(text))
}

/// What `volume create` and `volume clone` print: the admin endpoint's answer `doc` (with
/// `--json`), or a sentence.
fn print_created(doc: &serde_json::Value, json: bool, name: &str, clone_of: Option<&str>) {
    if json {
        println!("{doc}");
        return;
    }
    let quorum = if doc["on_write_quorum"] == true {
        "held by a write quorum of elements"
    } else {
        "not yet held by a write quorum of elements (they create it as they answer or come back)"
    };
    let size = config::format_size_approx(doc["size_bytes"].as_u64().unwrap_or(0));
    let mut origin = clone_of.map_or(String::new(), |snapshot| format!(", a clone of {snapshot}"));
    if let Some(group) = doc["group"].as_str() {
        origin = format!(", a member of consistency group {group}");
    }
    println!("created volume {name} ({size}){origin}, {quorum}; exported over NBD as {name}");
}

fn volume(args: VolumeArgs) -> Result<()> {
    let rt = runtime()?;
    match args.action {
        VolumeAction::Create(args) => {
            let target = &args.target;
            let tls = config::load_tls(target.tls_dir.as_deref())?;
            let mut path = format!("/volumes/create?name={}&size={}", config::percent_encode(&args.name), args.size);
            if let Some(group) = &args.group {
                path.push_str(&format!("&group={}", config::percent_encode(group)));
            }
            let body = rt
                .block_on(shell::admin::request(target.admin, "POST", &path, tls.as_ref()))
                .map_err(admin_error)
                .with_context(|| format!("volume {} was not created", args.name))?;
            let doc: serde_json::Value = serde_json::from_str(&body).context("admin endpoint sent bad JSON")?;
            print_created(&doc, target.json, &args.name, None);
        }
        VolumeAction::Clone(args) => {
            let target = &args.target;
            if args.snapshot.rsplit_once('@').is_none_or(|(v, n)| v.is_empty() || n.is_empty()) {
                bail!("{}: name the snapshot to clone as VOLUME@NAME (see starfish snapshot list)", args.snapshot);
            }
            let tls = config::load_tls(target.tls_dir.as_deref())?;
            let path = format!(
                "/volumes/clone?snapshot={}&name={}",
                config::percent_encode(&args.snapshot),
                config::percent_encode(&args.name)
            );
            let body = rt
                .block_on(shell::admin::request(target.admin, "POST", &path, tls.as_ref()))
                .map_err(admin_error)
                .with_context(|| format!("no clone {} of {} was created", args.name, args.snapshot))?;
            let doc: serde_json::Value = serde_json::from_str(&body).context("admin endpoint sent bad JSON")?;
            print_created(&doc, target.json, &args.name, Some(&args.snapshot));
        }
        VolumeAction::Delete(args) => {
            let target = &args.target;
            let tls = config::load_tls(target.tls_dir.as_deref())?;
            let mut path = format!("/volumes/delete?name={}", config::percent_encode(&args.name));
            if args.with_snapshots {
                path.push_str("&with_snapshots=1");
            }
            let body = rt
                .block_on(shell::admin::request(target.admin, "POST", &path, tls.as_ref()))
                .map_err(admin_error)
                .with_context(|| format!("volume {} was not deleted", args.name))?;
            let doc: serde_json::Value = serde_json::from_str(&body).context("admin endpoint sent bad JSON")?;
            if target.json {
                println!("{doc}");
            } else {
                let done = if doc["removed_everywhere"] == true {
                    "its space is freed on every element"
                } else if doc["removed_from_live_elements"] == true {
                    "its space is freed on every live element; the others free it when they come back"
                } else {
                    "the elements are freeing its space (not all answered yet)"
                };
                println!("deleted volume {}: no longer exported; {done}", args.name);
            }
        }
        VolumeAction::Resize(args) => {
            let target = &args.target;
            let tls = config::load_tls(target.tls_dir.as_deref())?;
            let mut path = format!("/volumes/resize?name={}&size={}", config::percent_encode(&args.name), args.size);
            if args.shrink {
                path.push_str("&shrink=1");
            }
            let body = rt
                .block_on(shell::admin::request(target.admin, "POST", &path, tls.as_ref()))
                .map_err(admin_error)
                .with_context(|| format!("volume {} was not resized", args.name))?;
            let doc: serde_json::Value = serde_json::from_str(&body).context("admin endpoint sent bad JSON")?;
            if target.json {
                println!("{doc}");
            } else {
                let quorum = if args.shrink && doc["on_write_quorum"] == true {
                    "what lay past the new end is zeroed on a write quorum of elements"
                } else if args.shrink {
                    "still zeroing what lies past the new end (the shrink is finished in the background)"
                } else if doc["on_write_quorum"] == true {
                    "held at that size by a write quorum of elements"
                } else {
                    "not yet held at that size by a write quorum of elements (they grow it as they answer or come back)"
                };
                println!(
                    "resized volume {} to {}, {quorum}; NBD clients that connect from now on see the new size",
                    args.name,
                    config::format_size_approx(args.size)
                );
            }
        }
        VolumeAction::List(VolumeListArgs { target }) => {
            let tls = config::load_tls(target.tls_dir.as_deref())?;
            let body = rt
                .block_on(shell::admin::get(target.admin, "/volumes", tls.as_ref()))
                .map_err(admin_error)
                .with_context(|| format!("cannot list the volumes of the host element at {}", target.admin))?;
            let doc: serde_json::Value = serde_json::from_str(&body).context("admin endpoint sent bad JSON")?;
            if target.json {
                println!("{doc}");
                return Ok(());
            }
            println!("{:<24} {:>12} {:>12}  {:<10}  {:<8}  STATE", "NAME", "SIZE", "STORED", "ORIGIN", "GROUP");
            for v in doc["volumes"].as_array().into_iter().flatten() {
                // The storage volume on the elements: larger than the size after a shrink.
                let stored = v["storage_bytes"].as_u64().or(v["size_bytes"].as_u64());
                println!(
                    "{:<24} {:>12} {:>12}  {:<10}  {:<8}  {}",
                    v["name"].as_str().unwrap_or("?"),
                    v["size_bytes"].as_u64().map_or("-".to_string(), config::format_size_approx),
                    stored.map_or("-".to_string(), config::format_size_approx),
                    v["origin"].as_str().unwrap_or("?"),
                    v["group"].as_str().unwrap_or("-"),
                    match v["clone_of"].as_str() {
                        Some(snapshot) => format!("{} (clone of {snapshot})", v["state"].as_str().unwrap_or("?")),
                        None => v["state"].as_str().unwrap_or("?").to_string(),
                    },
                );
            }
            if let Some(e) = doc["catalog_error"].as_str() {
                println!("catalog unreadable: {e} (volume operations are off)");
            }
        }
    }
    Ok(())
}

fn snapshot(args: SnapshotArgs) -> Result<()> {
    let rt = runtime()?;
    match args.action {
        SnapshotAction::Create(args) => {
            let target = &args.target;
            let (key, volume, name) = match (&args.group, &args.args[..]) {
                (None, [volume, name]) => ("volume", volume.clone(), name.clone()),
                (Some(group), [name]) => ("group", group.clone(), name.clone()),
                (None, _) => bail!("give the volume and the snapshot's name: starfish snapshot create VOLUME NAME"),
                (Some(_), _) => bail!(
                    "with --group GROUP, give the snapshot's name alone: starfish snapshot create --group GROUP NAME"
                ),
            };
            let tls = config::load_tls(target.tls_dir.as_deref())?;
            let path = format!(
                "/snapshots/create?{key}={}&name={}",
                config::percent_encode(&volume),
                config::percent_encode(&name)
            );
            let body = rt
                .block_on(shell::admin::request(target.admin, "POST", &path, tls.as_ref()))
                .map_err(admin_error)
                .with_context(|| format!("no snapshot {volume}@{name} was taken"))?;
            let doc: serde_json::Value = serde_json::from_str(&body).context("admin endpoint sent bad JSON")?;
            if target.json {
                println!("{doc}");
            } else {
                let exports = match doc["exports"].as_array() {
                    Some(names) => names.iter().filter_map(|n| n.as_str()).collect::<Vec<_>>().join(", "),
                    None => format!("{volume}@{name}"),
                };
                if doc["on_write_quorum"] == true {
                    println!(
                        "took snapshot {volume}@{name} (held by a write quorum of elements); exported read-only over NBD as {exports}"
                    );
                } else {
                    println!(
                        "taking snapshot {volume}@{name}: not yet held by a write quorum of elements (it is exported once it is; see starfish snapshot list)"
                    );
                }
            }
        }
        SnapshotAction::Delete(args) => {
            let target = &args.target;
            if args.snapshot.rsplit_once('@').is_none_or(|(v, n)| v.is_empty() || n.is_empty()) {
                bail!("{}: name a snapshot as VOLUME@NAME", args.snapshot);
            }
            let tls = config::load_tls(target.tls_dir.as_deref())?;
            let path = format!("/snapshots/delete?snapshot={}", config::percent_encode(&args.snapshot));
            let body = rt
                .block_on(shell::admin::request(target.admin, "POST", &path, tls.as_ref()))
                .map_err(admin_error)
                .with_context(|| format!("snapshot {} was not deleted", args.snapshot))?;
            let doc: serde_json::Value = serde_json::from_str(&body).context("admin endpoint sent bad JSON")?;
            if target.json {
                println!("{doc}");
            } else if doc["on_write_quorum"] == true {
                println!("deleted snapshot {}: no longer exported; its blocks are freed on a write quorum of elements (the others free them as they catch up)", args.snapshot);
            } else {
                println!(
                    "deleting snapshot {}: no longer exported; the elements free its blocks as they answer",
                    args.snapshot
                );
            }
        }
        SnapshotAction::List(SnapshotListArgs { target }) => {
            let tls = config::load_tls(target.tls_dir.as_deref())?;
            let body = rt
                .block_on(shell::admin::get(target.admin, "/snapshots", tls.as_ref()))
                .map_err(admin_error)
                .with_context(|| format!("cannot list the snapshots of the host element at {}", target.admin))?;
            let doc: serde_json::Value = serde_json::from_str(&body).context("admin endpoint sent bad JSON")?;
            if target.json {
                println!("{doc}");
                return Ok(());
            }
            println!("{:<32} {:<20} {:>12} {:>10}  STATE", "NAME", "VOLUME", "SIZE", "SEQUENCE");
            for s in doc["snapshots"].as_array().into_iter().flatten() {
                println!(
                    "{:<32} {:<20} {:>12} {:>10}  {}",
                    s["name"].as_str().unwrap_or("?"),
                    s["volume"].as_str().unwrap_or("?"),
                    s["size_bytes"].as_u64().map_or("-".to_string(), config::format_size_approx),
                    s["taken_at"].as_u64().map_or("-".to_string(), |t| t.to_string()),
                    match s["clones"].as_array().filter(|c| !c.is_empty()) {
                        Some(clones) => {
                            let names: Vec<&str> = clones.iter().filter_map(|c| c.as_str()).collect();
                            format!("{} (clones: {})", s["state"].as_str().unwrap_or("?"), names.join(", "))
                        }
                        None => s["state"].as_str().unwrap_or("?").to_string(),
                    },
                );
            }
            if let Some(e) = doc["catalog_error"].as_str() {
                println!("catalog unreadable: {e} (snapshots are off)");
            }
        }
    }
    Ok(())
}

fn scrub(args: ScrubArgs) -> Result<()> {
    let tls = config::load_tls(args.tls_dir.as_deref())?;
    let rt = runtime()?;
    let mut path = format!("/scrub?volume={}", config::percent_encode(&args.volume));
    if let Some(rate) = args.rate {
        path.push_str(&format!("&rate={rate}"));
    }
    let body = rt
        .block_on(shell::admin::request(args.admin, "POST", &path, tls.as_ref()))
        .with_context(|| format!("the host element at {} did not start the scrub", args.admin))?;
    let started: serde_json::Value = serde_json::from_str(&body).context("admin endpoint sent bad JSON")?;
    let id = started["id"].as_u64().context("the host element did not say which scrub it started")?;
    if args.no_wait {
        println!("scrub {id} of {} started; see starfish status", args.volume);
        return Ok(());
    }
    let mut last_line = String::new();
    let report = loop {
        std::thread::sleep(std::time::Duration::from_millis(500));
        let body = rt
            .block_on(shell::admin::get(args.admin, "/status", tls.as_ref()))
            .with_context(|| format!("cannot reach the host element at {}", args.admin))?;
        let doc: serde_json::Value = serde_json::from_str(&body).context("admin endpoint sent bad JSON")?;
        let volume = doc["volumes"].as_array().into_iter().flatten().find(|v| v["name"] == args.volume.as_str());
        let ours = volume.and_then(|v| v["scrubs"].as_array().into_iter().flatten().find(|s| s["id"] == id).cloned());
        let Some(scrub) = ours else {
            bail!("the host element no longer reports scrub {id} of {} (did it restart or hand over?)", args.volume);
        };
        if scrub["running"] != true {
            break scrub;
        }
        if !args.json && scrub["running"] == true {
            let (done, total) = (scrub["done_bytes"].as_u64().unwrap_or(0), scrub["total_bytes"].as_u64().unwrap_or(0));
            let line = format!(
                "scrubbing {}: {}/{} ({:.0}%)",
                args.volume,
                config::format_size_approx(done),
                config::format_size_approx(total),
                100.0 * done as f64 / total.max(1) as f64
            );
            if line != last_line {
                eprintln!("{line}");
                last_line = line;
            }
        }
    };
    let count = |key: &str| report[key].as_u64().unwrap_or(0);
    if args.json {
        println!("{report}");
    } else {
        println!(
            "scrub of {}: {} in {:.1}s; {} blocks agree, {} changed while it ran, {} repaired, {} without a majority, {} element errors",
            args.volume,
            config::format_size_approx(count("done_bytes")),
            count("elapsed_ms") as f64 / 1000.0,
            count("blocks_compared"),
            count("blocks_changed"),
            count("blocks_mismatched"),
            count("blocks_undecided"),
            count("element_errors"),
        );
        let repaired: Vec<&str> =
            report["repaired"].as_array().into_iter().flatten().filter_map(|v| v.as_str()).collect();
        if !repaired.is_empty() {
            println!("elements repaired by a full recovery from their peers: {}", repaired.join(", "));
        }
        if let Some(error) = report["last_error"].as_str() {
            println!("last element error: {error}");
        }
    }
    if count("blocks_undecided") + count("element_errors") > 0 {
        std::process::exit(4);
    }
    if count("blocks_mismatched") > 0 {
        std::process::exit(1);
    }
    Ok(())
}

/// `starfish status`'s line for a volume's beginning record that fewer than Q elements hold
/// (`beginning` in the status document; `None` when it is `null`).
fn beginning_line(b: &serde_json::Value, quorum: &serde_json::Value) -> Option<String> {
    if !b.is_object() {
        return None;
    }
    let reads = if b["reads_wait"] == true {
        format!("{} reads wait for it", b["reads_held"])
    } else {
        "reads no longer wait (start-up timeout passed)".to_string()
    };
    Some(format!(
        "  beginning (sequence {}) held by {} of {quorum} elements needed; {reads}",
        b["sequence"], b["held_by"]
    ))
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
            "{:<12} {:>14} {:<11} {:>14} {:>11.1}%{}",
            v["name"].as_str().unwrap_or("?"),
            config::format_size(v["size_bytes"].as_u64().unwrap_or(0)),
            v["mode"].as_str().unwrap_or("?"),
            v["acked_sequence"],
            100.0 * v["write_queue_used_bytes"].as_f64().unwrap_or(0.0)
                / v["write_queue_capacity_bytes"].as_f64().unwrap_or(1.0).max(1.0),
            v["group"].as_str().map_or(String::new(), |g| format!("  group {g} (its sequence and queue)")),
        );
        if let Some(line) = beginning_line(&v["beginning"], &doc["quorum"]) {
            println!("{line}");
        }
        let s = &v["scrub"];
        if s.is_object() {
            let (done, total) = (s["done_bytes"].as_u64().unwrap_or(0), s["total_bytes"].as_u64().unwrap_or(0));
            let state = if s["running"] == true {
                format!(
                    "running {:.0}% of {}",
                    100.0 * done as f64 / total.max(1) as f64,
                    config::format_size_approx(total)
                )
            } else {
                format!(
                    "done, {} in {:.1}s",
                    config::format_size_approx(total),
                    s["elapsed_ms"].as_f64().unwrap_or(0.0) / 1000.0
                )
            };
            println!(
                "  scrub ({}): {state}; {} repaired, {} without a majority, {} element errors",
                s["reason"].as_str().unwrap_or("?"),
                s["blocks_mismatched"],
                s["blocks_undecided"],
                s["element_errors"]
            );
        }
    }
    println!("{:<10} {:<22} {:<11} {:<12} {:>8} {:>9}  DETAIL", "ELEMENT", "ADDRESS", "STATE", "ACK", "LAG", "RTT ms");
    for e in doc["elements"].as_array().into_iter().flatten() {
        let detail = if let Some(r) = e.get("recovery") {
            let kind = r["kind"].as_str().unwrap_or("?");
            let source = r["source"].as_str().unwrap_or("?");
            let waiting: Vec<&str> =
                r["waiting_for_source"].as_array().into_iter().flatten().filter_map(|v| v.as_str()).collect();
            if !waiting.is_empty() && r["phase"] != "copy" {
                format!(
                    "{kind} recovery of {} waits for a peer to copy from (none in sync, none holds it current)",
                    waiting.join(", ")
                )
            } else if r["phase"] == "copy" {
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
            "{:<10} {:<22} {:<11} {:<12} {:>8} {:>9}  {}",
            e["name"].as_str().unwrap_or("?"),
            e["address"].as_str().unwrap_or("?"),
            e["state"].as_str().unwrap_or("?"),
            e["ack_policy"].as_str().unwrap_or("durable"),
            e["lag"],
            rtt,
            detail
        );
    }
    // Reads held back by an element's read window (see `limits::READ_WINDOW_MS`): shown only
    // while there are any, with what is out at each element that has reads out.
    let waiting = &doc["reads_waiting"];
    if waiting["count"].as_u64().unwrap_or(0) == 0 {
        return;
    }
    let out: Vec<String> = doc["elements"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["reads"]["out_bytes"].as_u64().unwrap_or(0) > 0)
        .map(|e| {
            let window = e["reads"]["window_bytes"]
                .as_u64()
                .map_or(String::new(), |w| format!(" of a {} window", config::format_size_approx(w)));
            let out = config::format_size_approx(e["reads"]["out_bytes"].as_u64().unwrap_or(0));
            format!("{} {out}{window}", e["name"].as_str().unwrap_or("?"))
        })
        .collect();
    println!(
        "reads waiting for an element's read window: {} ({}); out: {}",
        waiting["count"],
        config::format_size_approx(waiting["bytes"].as_u64().unwrap_or(0)),
        out.join(", ")
    );
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
        let tls_dir = data.join("tls");
        if !args.no_tls {
            demo_certificates(&tls_dir, &sites.map(|(name, _)| name))?;
        }
        let load = |name: &str| config::load_tls((!args.no_tls).then(|| tls_dir.join(name)).as_deref());
        let mut elements = Vec::new();
        let mut links = Vec::new();
        for (i, (name, delay_ms)) in sites.iter().enumerate() {
            let port = args.element_port + i as u16;
            let listen: SocketAddr = format!("127.0.0.1:{port}").parse().expect("valid address");
            let options = ElementOptions {
                listen,
                data: data.join(name),
                store: StoreOptions::default(),
                tls: load(name)?,
                insecure: false,
                local_socket: true,
            };
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
            elements.push(config::ElementEntry { name: name.to_string(), address, ack: None, fec: None, rate: None });
        }
        let file = HostFile {
            nbd: Some(args.nbd),
            admin: Some(args.admin),
            quorum: Some(2),
            element: elements,
            volume: vec![volume.clone()],
            ..HostFile::default()
        };
        let mut options = file.into_options()?;
        options.tls = load("demo-host")?;
        let host = shell::host::start(options).await?;
        println!("StarFish demo: 3 elements (local 0 ms, near 1 ms, far 8 ms one-way), write quorum 2");
        println!("data directory: {}", data.display());
        if args.no_tls {
            let uri = format!("nbd://{}/{}", args.nbd, volume.name);
            println!("volume {} ({}) exported at: {uri}", volume.name, volume.size);
            println!();
            println!("Use it from a host:");
            println!("  nbdinfo {uri}");
            println!("  qemu-io -f raw -c 'write -P 0xab 0 1M' -c 'read -P 0xab 0 1M' {uri}");
            println!("  nbdfuse /tmp/sf/disk {uri} &  then  mkfs.ext4 /tmp/sf/disk  (or losetup + mount)");
        } else {
            let admin = tls_dir.join("admin");
            let uri = format!("nbds://{}/{}?tls-certificates={}", args.nbd, volume.name, admin.display());
            println!("mutual TLS between the processes; NBD over TLS only (certificates in {})", tls_dir.display());
            println!("volume {} ({}) exported at: {uri}", volume.name, volume.size);
            println!();
            println!("Use it from a host:");
            println!("  nbdinfo '{uri}'");
            println!(
                "  qemu-io --object tls-creds-x509,id=tls0,endpoint=client,dir={} \\\n      \
                 --image-opts driver=raw,file.driver=nbd,file.host={},file.port={},file.export={},file.tls-creds=tls0 \\\n      \
                 -c 'write -P 0xab 0 1M' -c 'read -P 0xab 0 1M'",
                admin.display(),
                args.nbd.ip(),
                args.nbd.port(),
                volume.name
            );
            println!("  nbdfuse /tmp/sf/disk '{uri}' &  then  mkfs.ext4 /tmp/sf/disk  (or losetup + mount)");
        }
        println!("  starfish status --admin {}", args.admin);
        println!("Live status page (a browser on this machine): http://{}/", args.admin);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_element_has_one_worker_per_two_cores_and_at_least_one() {
        assert_eq!([1, 2, 3, 4, 16, 64].map(element_workers), [1, 1, 1, 2, 8, 32]);
    }

    #[test]
    fn a_beginning_fewer_than_q_hold_gets_a_line_under_its_volume() {
        // As the host element's admin server writes it.
        let json = |b| shell::admin::beginning_json(Some(b));
        let quorum = serde_json::json!(2);
        assert_eq!(beginning_line(&shell::admin::beginning_json(None), &quorum), None);
        let waiting = starfish_core::BeginningStatus {
            sequence: proto::Sequence(7),
            held_by: 1,
            reads_wait: true,
            reads_held: 3,
        };
        assert_eq!(
            beginning_line(&json(waiting), &quorum).as_deref(),
            Some("  beginning (sequence 7) held by 1 of 2 elements needed; 3 reads wait for it")
        );
        let overdue = json(starfish_core::BeginningStatus { held_by: 0, reads_wait: false, reads_held: 0, ..waiting });
        assert_eq!(
            beginning_line(&overdue, &quorum).as_deref(),
            Some("  beginning (sequence 7) held by 0 of 2 elements needed; reads no longer wait (start-up timeout passed)")
        );
    }
}
