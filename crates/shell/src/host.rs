//! The host element's shell: one actor task owns the sans-IO [`HostCore`]; element sessions,
//! NBD connections and the admin endpoint talk to it through a channel.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use proto::{decode_frame, ElementMessage, Op};
use starfish_core::groups::ExportedVolume;
use starfish_core::{catalog, Reply};
use starfish_core::{Action, ElementId, Event, HostConfig, HostCore, HostError, HostStatus, Time, Token};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crate::nbd_server::{self, Backend, BoxFuture, ExportInfo, Extent, ServerOptions};
use crate::outgoing::Outgoing;

/// Where the host element listens and which elements it uses.
#[derive(Clone, Debug)]
pub struct HostOptions {
    pub nbd: SocketAddr,
    pub admin: SocketAddr,
    /// Element addresses, in the order of `config.elements`.
    pub element_addresses: Vec<SocketAddr>,
    /// Per element: reached over the far link (UDP with FEC, these parameters), or over TCP
    /// (`None`). Empty: every element over TCP.
    pub element_links: Vec<Option<crate::far_link::FarLinkOptions>>,
    pub config: HostConfig,
    pub failover: FailoverOptions,
    /// Mutual TLS toward the elements, NBD over TLS only, admin changes by certificate.
    pub tls: Option<crate::tls::TlsContext>,
    /// With `tls`: NBD clients must present a certificate of the cluster's CA (an `admin` or
    /// `client` one).
    pub nbd_tls_verify_peer: bool,
    /// Serve plain TCP beyond loopback (`--insecure`).
    pub insecure: bool,
    /// When the catalog's intentions are written (`--intention-log`).
    pub intention_log: starfish_core::catalog::LogPolicy,
    /// Reach elements on this machine over their local socket when they have one
    /// (`crate::local_socket`); `--no-local-socket` turns it off.
    pub local_socket: bool,
    /// How long an NBD client may stall inside a request or leave a reply untaken
    /// (`--nbd-stall-timeout`; [`ServerOptions::stall_timeout`]).
    pub nbd_stall_timeout: std::time::Duration,
}

/// How this host element shares the cluster with others (see `crate::node`).
#[derive(Clone, Debug, Default)]
pub struct FailoverOptions {
    /// Start as a standby: connect to nothing, serve nothing, until told (`starfish
    /// failover`) or, with `etcd`, until elected and the elements say the active one is gone.
    pub standby: bool,
    /// etcd endpoint (`http://127.0.0.1:2379`): automatic takeover.
    pub etcd: Option<String>,
    /// Names the cluster's keys in etcd.
    pub cluster: String,
    /// With `etcd`: how long the elements must have missed the active host element.
    pub takeover_after_ms: u64,
}

pub(crate) enum Request {
    /// A read of the storage volume, or of one of its snapshots.
    Read {
        offset_bytes: u64,
        length_bytes: u32,
        snapshot: Option<proto::SnapshotRef>,
    },
    Write(Op),
    Flush,
    BlockStatus {
        offset_bytes: u64,
        length_bytes: u64,
        snapshot: Option<proto::SnapshotRef>,
    },
}

enum Input {
    Host {
        volume: u32,
        request: Request,
        reply: oneshot::Sender<Reply>,
    },
    Connected {
        element: ElementId,
        session: u64,
        frames: mpsc::UnboundedSender<Frame>,
        close: oneshot::Sender<()>,
    },
    /// A session's writer put these records on the wire (flushed to its socket): for a
    /// `network-sync` element, the highest sequence per volume.
    /// Bytes of a message from an element arrived, but not the whole message yet.
    Progress {
        element: ElementId,
        session: u64,
    },
    Sent {
        element: ElementId,
        session: u64,
        through: Vec<(proto::VolumeId, proto::Sequence)>,
    },
    Message {
        element: ElementId,
        session: u64,
        message: ElementMessage,
    },
    Disconnected {
        element: ElementId,
        session: u64,
        reason: String,
    },
    Status {
        reply: oneshot::Sender<HostStatus>,
    },
    /// Start a scrub of a volume (`POST /scrub`).
    Scrub {
        volume: String,
        rate_bytes_per_s: u64,
        reply: oneshot::Sender<Result<u64, String>>,
    },
    /// A graceful handover, after the NBD server drained: tell every element we are gone.
    Release {
        reply: oneshot::Sender<()>,
    },
    /// New, empty volumes (see `HostCore::add_volumes`).
    AddVolumes {
        added: Vec<(String, proto::VolumeSpec)>,
        reply: oneshot::Sender<Result<Vec<proto::VolumeId>, String>>,
    },
    /// Would these new volumes fit on every live element (`HostCore::check_volumes`)?
    CheckVolumes {
        specs: Vec<proto::VolumeSpec>,
        reply: oneshot::Sender<Reply>,
    },
    /// Start over serving these volumes too (`HostCore::restart_with_volumes`).
    RestartWithVolumes {
        added: Vec<(String, proto::VolumeSpec)>,
        /// Storage volumes exported smaller than they are, with their exported sizes.
        shrunk: Vec<(String, u64)>,
        /// Volumes that joined consistency groups while running.
        joined: Vec<starfish_core::groups::JoinedMember>,
        /// Storage volumes of groups grown by joins, with their sizes.
        grown: Vec<(String, u64)>,
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// A volume joins a consistency group while running (`HostCore::join_group`).
    JoinGroup {
        member: starfish_core::groups::JoinedMember,
        reply: oneshot::Sender<Result<proto::VolumeId, String>>,
    },
    /// A member that joined a consistency group leaves it (`HostCore::leave_group`).
    LeaveGroup {
        name: String,
        reply: oneshot::Sender<Result<proto::VolumeId, String>>,
    },
    /// Remove volumes while running (`HostCore::remove_volumes`).
    RemoveVolumes {
        names: Vec<String>,
        reply: oneshot::Sender<Result<Vec<proto::VolumeId>, String>>,
    },
    /// Resize a volume while running (`HostCore::resize_volume`).
    ResizeVolume {
        name: String,
        storage_bytes: u64,
        size_bytes: u64,
        reply: oneshot::Sender<Result<proto::VolumeId, String>>,
    },
    /// Export a snapshot read-only (`HostCore::add_snapshot_export`).
    AddSnapshotExport {
        name: String,
        of: String,
        snapshot: proto::SnapshotRef,
        size_bytes: u64,
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// Stop exporting a snapshot (`HostCore::remove_snapshot_export`).
    RemoveSnapshotExport {
        name: String,
        reply: oneshot::Sender<()>,
    },
    /// `input`, from the catalog task as it was before the core's `generation`-th takeover
    /// (`Event::Restarted`): dropped (its reply with it) once the core took over again, so
    /// that nothing the catalog task decided from a catalog read before reaches the core after
    /// (a newer host element may have changed the catalog since).
    Guarded {
        generation: u64,
        input: Box<Input>,
    },
}

/// What the catalog hears of volume operations from the core.
#[derive(Clone, Copy, Debug)]
pub(crate) enum VolumeEvent {
    Created(proto::VolumeId),
    Removed {
        volume: proto::VolumeId,
        everywhere: bool,
    },
    Resized(proto::VolumeId),
    /// The core took the elements back from a host element that is gone and serves the
    /// configured volumes only: the catalog is read again (that one may have changed it),
    /// by a catalog task of this generation (`HostHandle::guarded`).
    Restarted {
        generation: u64,
    },
}

/// A frame for an element's session, with the record it carries when the element's ack policy
/// counts it once it is on the wire (`network-sync`).
type Frame = (proto::FrameParts, Option<(proto::VolumeId, proto::Sequence)>);

struct Session {
    id: u64,
    frames: mpsc::UnboundedSender<Frame>,
    _close: oneshot::Sender<()>,
}

/// The volumes exported over NBD, shared by the NBD server, the status and the catalog (which
/// adds volumes created while running).
pub(crate) type Exports = Arc<std::sync::RwLock<ExportTable>>;

/// The exports, in the core's order, and found by name: every NBD request looks its export
/// up, and a host element may export many (each snapshot is an export of its own).
pub(crate) struct ExportTable {
    list: Vec<ExportedVolume>,
    by_name: HashMap<String, usize>,
}

impl ExportTable {
    pub(crate) fn new(list: Vec<ExportedVolume>) -> ExportTable {
        let mut by_name = HashMap::with_capacity(list.len());
        for (i, export) in list.iter().enumerate() {
            // The first of two equal names wins, as a search from the front would have it.
            by_name.entry(export.name.clone()).or_insert(i);
        }
        ExportTable { list, by_name }
    }

    pub(crate) fn get(&self, name: &str) -> Option<&ExportedVolume> {
        self.by_name.get(name).map(|&i| &self.list[i])
    }

    pub(crate) fn list(&self) -> &[ExportedVolume] {
        &self.list
    }
}

/// What NBD serves from now on: what the core exports (the catalog's own volume is not among
/// them).
fn publish_exports(exports: &Exports, core: &HostCore) {
    *exports.write().expect("exports lock") = ExportTable::new(core.config().exported());
}

/// How each element is reached now, in configuration order (see [`HostHandle::links`]).
type Links = Arc<Vec<std::sync::Mutex<String>>>;

/// How often `HostHandle::wait_level` looks again.
const LEVEL_POLL: Duration = Duration::from_millis(5);

/// NBD connections in the transmission phase, per export name, and the exports closed to new
/// ones (a deletion or a shrink under way), under one lock: a volume operation that finds no
/// client and closes the export does both in one step, so no client slips in between.
pub(crate) type Clients = Arc<std::sync::Mutex<ClientTable>>;

#[derive(Default)]
pub(crate) struct ClientTable {
    /// Connections per export; an export with none is absent.
    connected: HashMap<String, usize>,
    /// Exports closed to new connections, with the reason a client is told.
    closed: HashMap<String, String>,
}

impl ClientTable {
    /// A connection enters the transmission phase on `export`: counted, unless the export is
    /// closed to new ones (`Err`: the reason the client is told).
    fn open(&mut self, export: &str) -> Result<(), String> {
        if let Some(reason) = self.closed.get(export) {
            return Err(reason.clone());
        }
        *self.connected.entry(export.to_string()).or_default() += 1;
        Ok(())
    }

    /// A counted connection to `export` ended.
    fn end(&mut self, export: &str) {
        if let Some(n) = self.connected.get_mut(export) {
            *n -= 1;
            if *n == 0 {
                self.connected.remove(export);
            }
        }
    }

    /// Close `export` to new connections (clients are told `reason`) if none is connected and
    /// no other operation closed it.
    fn close(&mut self, export: &str, reason: String) -> Result<(), NotClosed> {
        if let Some(&connected) = self.connected.get(export) {
            return Err(NotClosed::Connected(connected));
        }
        if let Some(other) = self.closed.get(export) {
            return Err(NotClosed::Closing(other.clone()));
        }
        self.closed.insert(export.to_string(), reason);
        Ok(())
    }

    /// Why `export` is closed to new connections, if it is: what a client that asks for it
    /// is told, even once it is no longer exported (a deletion removes the export before it
    /// is answered; a starting host element does not export a snapshot being deleted).
    fn closed_reason(&self, export: &str) -> Option<String> {
        self.closed.get(export).cloned()
    }

    /// Open `export` to new connections again.
    fn reopen(&mut self, export: &str) {
        self.closed.remove(export);
    }
}

/// Why `HostHandle::close_to_clients` did not close an export.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NotClosed {
    /// This many NBD connections use it.
    Connected(usize),
    /// Another operation closed it: the reason it gives clients.
    Closing(String),
}

/// An export closed to new NBD connections (`HostHandle::close_to_clients`) until this is
/// dropped.
pub(crate) struct ClosedToClients {
    clients: Clients,
    export: String,
}

impl Drop for ClosedToClients {
    fn drop(&mut self) {
        self.clients.lock().expect("clients lock").reopen(&self.export);
    }
}

/// A handle to a running host element.
#[derive(Clone)]
pub struct HostHandle {
    inputs: mpsc::UnboundedSender<Input>,
    addresses: Arc<Vec<String>>,
    links: Links,
    exports: Exports,
    clients: Clients,
    metrics: crate::metrics::HostMetrics,
    volume_orders: mpsc::UnboundedSender<crate::volumes::VolumeOrder>,
    /// Set for the catalog task: its inputs go as `Input::Guarded` with this generation.
    generation: Option<u64>,
}

impl HostHandle {
    /// This handle for the catalog task as of the core's `generation`-th takeover: what it
    /// sends is dropped once the core took over again.
    pub(crate) fn guarded(&self, generation: u64) -> HostHandle {
        HostHandle { generation: Some(generation), ..self.clone() }
    }

    fn send(&self, input: Input) -> Result<(), ()> {
        let input = match self.generation {
            Some(generation) => Input::Guarded { generation, input: Box::new(input) },
            None => input,
        };
        self.inputs.send(input).map_err(|_| ())
    }

    /// Element addresses, in configuration order.
    pub fn addresses(&self) -> &[String] {
        &self.addresses
    }

    /// The volumes exported over NBD (with their groups).
    pub fn exports(&self) -> Vec<ExportedVolume> {
        self.exports.read().expect("exports lock").list().to_vec()
    }

    /// The metrics page (OpenMetrics text): what was measured, and the core's status now.
    pub(crate) async fn metrics_text(&self, active: bool) -> Option<String> {
        let status = self.status().await?;
        let clients = self.clients();
        Some(self.metrics.encode(active, Some((&status, &self.exports(), &clients))))
    }

    /// NBD connections per export now.
    pub(crate) fn clients(&self) -> HashMap<String, usize> {
        self.clients.lock().expect("clients lock").connected.clone()
    }

    /// Reads and writes answered so far, with their latency buckets (the status page's charts).
    pub(crate) fn chart_totals(&self) -> (crate::metrics::KindTotals, crate::metrics::KindTotals) {
        self.metrics.chart_totals()
    }

    /// Close `export` to new NBD connections, if no client is connected to it and no other
    /// operation closed it, until the returned guard is dropped. A client that asks for it
    /// meanwhile is refused with `reason`.
    pub(crate) fn close_to_clients(&self, export: &str, reason: String) -> Result<ClosedToClients, NotClosed> {
        self.clients.lock().expect("clients lock").close(export, reason)?;
        Ok(ClosedToClients { clients: self.clients.clone(), export: export.to_string() })
    }

    /// Hand a volume operation to the catalog (`starfish volume …`).
    pub(crate) async fn volume_order<T>(
        &self,
        order: impl FnOnce(oneshot::Sender<Result<T, String>>) -> crate::volumes::VolumeOrder,
    ) -> Result<T, String> {
        let (reply, rx) = oneshot::channel();
        self.volume_orders.send(order(reply)).map_err(|_| "host element stopping".to_string())?;
        rx.await.map_err(|_| "host element stopping".to_string())?
    }

    /// A request to the core with offsets in storage volume `volume`.
    pub(crate) async fn storage_request(&self, volume: u32, request: Request) -> Option<Reply> {
        let (reply, rx) = oneshot::channel();
        self.send(Input::Host { volume, request, reply }).ok()?;
        rx.await.ok()
    }

    pub(crate) async fn add_volumes(
        &self,
        added: Vec<(String, proto::VolumeSpec)>,
    ) -> Result<Vec<proto::VolumeId>, String> {
        let (reply, rx) = oneshot::channel();
        self.send(Input::AddVolumes { added, reply }).map_err(|_| "host element stopping")?;
        rx.await.map_err(|_| "host element stopping")?
    }

    pub(crate) async fn check_volumes(&self, specs: Vec<proto::VolumeSpec>) -> Result<(), String> {
        let (reply, rx) = oneshot::channel();
        self.send(Input::CheckVolumes { specs, reply }).map_err(|_| "host element stopping")?;
        match rx.await {
            Ok(Reply::Checked(result)) => result,
            _ => Err("host element stopping".into()),
        }
    }

    pub(crate) async fn restart_with_volumes(
        &self,
        added: Vec<(String, proto::VolumeSpec)>,
        shrunk: Vec<(String, u64)>,
        joined: Vec<starfish_core::groups::JoinedMember>,
        grown: Vec<(String, u64)>,
    ) -> Result<(), String> {
        let (reply, rx) = oneshot::channel();
        let input = Input::RestartWithVolumes { added, shrunk, joined, grown, reply };
        self.send(input).map_err(|_| "host element stopping")?;
        rx.await.map_err(|_| "host element stopping")?
    }

    /// A volume joins a consistency group (see `HostCore::join_group`): the group's storage
    /// volume.
    pub(crate) async fn join_group(
        &self,
        member: starfish_core::groups::JoinedMember,
    ) -> Result<proto::VolumeId, String> {
        let (reply, rx) = oneshot::channel();
        self.send(Input::JoinGroup { member, reply }).map_err(|_| "host element stopping")?;
        rx.await.map_err(|_| "host element stopping")?
    }

    /// A member leaves its consistency group (see `HostCore::leave_group`): the group's
    /// storage volume.
    pub(crate) async fn leave_group(&self, name: String) -> Result<proto::VolumeId, String> {
        let (reply, rx) = oneshot::channel();
        self.send(Input::LeaveGroup { name, reply }).map_err(|_| "host element stopping")?;
        rx.await.map_err(|_| "host element stopping")?
    }

    /// Remove volumes (storage names) while running (see `HostCore::remove_volumes`).
    pub(crate) async fn remove_volumes(&self, names: Vec<String>) -> Result<Vec<proto::VolumeId>, String> {
        let (reply, rx) = oneshot::channel();
        self.send(Input::RemoveVolumes { names, reply }).map_err(|_| "host element stopping")?;
        rx.await.map_err(|_| "host element stopping")?
    }

    /// Resize a volume (storage name) while running (see `HostCore::resize_volume`).
    pub(crate) async fn resize_volume(
        &self,
        name: String,
        storage_bytes: u64,
        size_bytes: u64,
    ) -> Result<proto::VolumeId, String> {
        let (reply, rx) = oneshot::channel();
        let input = Input::ResizeVolume { name, storage_bytes, size_bytes, reply };
        self.send(input).map_err(|_| "host element stopping")?;
        rx.await.map_err(|_| "host element stopping")?
    }

    /// Export snapshot `snapshot` of the volume exported as `of`, read-only, as `name`.
    pub(crate) async fn add_snapshot_export(
        &self,
        name: String,
        of: String,
        snapshot: proto::SnapshotRef,
        size_bytes: u64,
    ) -> Result<(), String> {
        let (reply, rx) = oneshot::channel();
        let input = Input::AddSnapshotExport { name, of, snapshot, size_bytes, reply };
        self.send(input).map_err(|_| "host element stopping")?;
        rx.await.map_err(|_| "host element stopping")?
    }

    /// Stop exporting snapshot export `name`.
    pub(crate) async fn remove_snapshot_export(&self, name: String) {
        let (reply, rx) = oneshot::channel();
        if self.send(Input::RemoveSnapshotExport { name, reply }).is_ok() {
            let _ = rx.await;
        }
    }

    /// How each element is reached ("tcp", "local socket", or the far link's parameters), in
    /// configuration order: as its session now is, or as it will be tried.
    pub fn links(&self) -> Vec<String> {
        self.links.iter().map(|l| l.lock().expect("link lock").clone()).collect()
    }

    pub async fn status(&self) -> Option<HostStatus> {
        let (reply, rx) = oneshot::channel();
        self.inputs.send(Input::Status { reply }).ok()?;
        rx.await.ok()
    }

    /// Wait up to `within` until every in-sync element has applied every write this host
    /// element sent it (a status `lag` of 0 each): `Err` with the elements still behind then,
    /// as `name (lag)`.
    pub(crate) async fn wait_level(&self, within: Duration) -> Result<(), String> {
        let until = Instant::now() + within;
        loop {
            let Some(status) = self.status().await else { return Err("the host element's core is gone".into()) };
            let behind: Vec<String> = status
                .elements
                .iter()
                .filter(|e| e.state == "in-sync" && e.lag > 0)
                .map(|e| format!("{} ({} writes)", e.name, e.lag))
                .collect();
            if behind.is_empty() {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(behind.join(", "));
            }
            tokio::time::sleep(LEVEL_POLL).await;
        }
    }

    /// Start scrubbing `volume` at most `rate_bytes_per_s` (0: unlimited); the scrub's id.
    pub async fn scrub(&self, volume: &str, rate_bytes_per_s: u64) -> Result<u64, String> {
        let (reply, rx) = oneshot::channel();
        let volume = volume.to_string();
        self.inputs.send(Input::Scrub { volume, rate_bytes_per_s, reply }).map_err(|_| "host element stopping")?;
        rx.await.map_err(|_| "host element stopping")?
    }

    /// Send `Release` to every element (see `Input::Release`).
    pub(crate) async fn release(&self) {
        let (reply, rx) = oneshot::channel();
        if self.inputs.send(Input::Release { reply }).is_ok() {
            let _ = rx.await;
        }
    }
}

/// A running active host element: its tasks (stopped by dropping them) and its NBD server.
pub(crate) struct Active {
    pub handle: HostHandle,
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
    pub nbd: tokio::task::JoinHandle<()>,
    pub drain: tokio::sync::watch::Sender<bool>,
    pub epoch: proto::Epoch,
}

impl Active {
    /// Stop at once (no drain): what a superseded host element does.
    pub fn abort(self) {
        self.nbd.abort();
        for task in self.tasks {
            task.abort();
        }
    }
}

/// Start serving as the active host element with `config` (its epoch and identity set by the
/// caller). NBD is served on `nbd_listener`, or, if none, on `options.nbd` as soon as it can
/// be bound (a takeover on the same machine: the old host element may still hold it).
/// `superseded` hears once the core is, with the newer epoch the elements follow.
pub(crate) fn start_active(
    options: &HostOptions,
    config: HostConfig,
    nbd_listener: Option<TcpListener>,
    superseded: mpsc::UnboundedSender<proto::Epoch>,
) -> Active {
    let (inputs, rx) = mpsc::unbounded_channel();
    let addresses = options.element_addresses.iter().map(|a| a.to_string()).collect();
    let far_links: Vec<_> =
        (0..options.element_addresses.len()).map(|i| options.element_links.get(i).copied().flatten()).collect();
    let links: Links = Arc::new(far_links.iter().map(|l| std::sync::Mutex::new(describe_link(l.as_ref()))).collect());
    // The catalog of volumes created while running is a storage volume of its own, never
    // exported over NBD.
    let mut config = config;
    let exports: Exports = Arc::new(std::sync::RwLock::new(ExportTable::new(config.exported())));
    if !config.volumes.iter().any(|v| v.name == catalog::CATALOG_VOLUME) {
        config.exports = config.exported();
        config.volumes.push(proto::VolumeSpec {
            name: catalog::CATALOG_VOLUME.into(),
            size_bytes: catalog::CATALOG_VOLUME_BYTES,
            clone_of: None,
            at_least: false,
        });
    }
    let (volume_orders, orders_rx) = mpsc::unbounded_channel();
    let (volume_events, events_rx) = mpsc::unbounded_channel();
    let clients: Clients = Arc::default();
    let metrics = crate::metrics::HostMetrics::default();
    let handle = HostHandle {
        inputs: inputs.clone(),
        addresses: Arc::new(addresses),
        links: links.clone(),
        exports: exports.clone(),
        clients: clients.clone(),
        metrics: metrics.clone(),
        volume_orders,
        generation: None,
    };
    let origin = Instant::now();
    let epoch = config.epoch;
    let core = HostCore::new(config.clone(), Time(0));
    tracing::info!(
        first_epoch = %config.epoch,
        host_id = %config.host_id,
        quorum = config.quorum,
        elements = config.elements.len(),
        "host element starting"
    );
    let names = config.elements.clone();
    let actor = run_actor(core, origin, rx, names, superseded, volume_events, exports.clone());
    let mut tasks = vec![tokio::spawn(actor)];
    let (loaded_tx, mut loaded_rx) = tokio::sync::watch::channel(false);
    tasks.push(tokio::spawn(crate::volumes::run(
        handle.clone(),
        options.intention_log,
        orders_rx,
        events_rx,
        loaded_tx,
    )));
    for (i, address) in options.element_addresses.iter().enumerate() {
        let tls = options.tls.clone();
        let route = Route { address: *address, far: far_links[i], local: options.local_socket, links: links.clone() };
        tasks.push(tokio::spawn(run_element_link(ElementId(i as u8), route, inputs.clone(), tls)));
    }
    let backend = Arc::new(HostBackend { inputs: inputs.clone(), exports, clients, metrics });
    let (drain, drain_rx) = tokio::sync::watch::channel(false);
    let tls =
        options.tls.clone().map(|context| nbd_server::NbdTls { context, verify_peer: options.nbd_tls_verify_peer });
    let server_options = ServerOptions {
        multi_conn: true,
        drain: Some(drain_rx),
        tls,
        stall_timeout: options.nbd_stall_timeout,
        ..ServerOptions::default()
    };
    let address = options.nbd;
    let startup_timeout = Duration::from_millis(config.startup_timeout_ms);
    let nbd = tokio::spawn(async move {
        let listener = match nbd_listener {
            Some(listener) => listener,
            None => bind_when_free(address).await,
        };
        // Volumes created while an earlier host element ran are served from the start: NBD
        // clients wait in the listen queue until the catalog is read — at most the start-up
        // timeout, after which requests would fail anyway; the configured volumes are served
        // then, and the catalog's join once it is read.
        let wait = tokio::time::timeout(startup_timeout, loaded_rx.wait_for(|loaded| *loaded));
        if wait.await.is_err() {
            tracing::warn!("the catalog is not read yet (too few elements): serving the configured volumes; volumes created while running join once it is");
        }
        if let Err(e) = nbd_server::serve(listener, backend, server_options).await {
            tracing::error!(error = %e, "NBD server stopped");
        }
    });
    Active { handle, tasks, nbd, drain, epoch }
}

/// Start the host element (see `crate::node`): its admin endpoint at once, and either the
/// active host element or a standby. Returns once everything listens.
pub async fn start(options: HostOptions) -> std::io::Result<Arc<crate::node::Node>> {
    crate::node::start(options).await
}

/// Bind `address`, waiting while another process holds it (said once, then every minute).
async fn bind_when_free(address: SocketAddr) -> TcpListener {
    let mut said: Option<Instant> = None;
    loop {
        match TcpListener::bind(address).await {
            Ok(listener) => {
                if said.is_some() {
                    tracing::info!(nbd = %address, "NBD address free again: serving");
                }
                return listener;
            }
            Err(e) => {
                if said.is_none_or(|at| at.elapsed() > Duration::from_secs(60)) {
                    tracing::warn!(nbd = %address, error = %e, "cannot listen for NBD yet (the old host element may hold the address); retrying");
                    said = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

fn now(origin: Instant) -> Time {
    Time(origin.elapsed().as_micros() as u64)
}

async fn run_actor(
    mut core: HostCore,
    origin: Instant,
    mut rx: mpsc::UnboundedReceiver<Input>,
    names: Vec<String>,
    superseded: mpsc::UnboundedSender<proto::Epoch>,
    volume_events: mpsc::UnboundedSender<VolumeEvent>,
    exports: Exports,
) {
    let mut sessions: Vec<Option<Session>> = names.iter().map(|_| None).collect();
    let mut waiting: HashMap<Token, oneshot::Sender<Reply>> = HashMap::new();
    let mut next_token = 0u64;
    loop {
        let deadline = core.poll_timeout();
        let sleep = async {
            match deadline {
                Some(t) => {
                    let at = origin + Duration::from_micros(t.0);
                    tokio::time::sleep_until(at.into()).await
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            input = rx.recv() => {
                let Some(input) = input else { return };
                let mut input = Some(input);
                // Take what else is already waiting, so bursts are handled together.
                for _ in 0..256 {
                    let Some(one) = input.take().or_else(|| rx.try_recv().ok()) else { break };
                    let one = match one {
                        Input::Guarded { generation, input } if generation == core.takeovers() => *input,
                        // From before a takeover: dropped.
                        Input::Guarded { .. } => continue,
                        one => one,
                    };
                    handle_input(&mut core, origin, one, &mut sessions, &mut waiting, &mut next_token, &exports);
                }
            }
            _ = sleep => core.handle_timeout(now(origin)),
        }
        while let Some(action) = core.poll_action() {
            match action {
                Action::Send { to, message } => {
                    // A large write's data is not copied: the frame shares the payload.
                    let frame = proto::encode_host_frame(&message);
                    let record = match &message {
                        proto::HostMessage::Apply(r) => Some((r.volume, r.sequence)),
                        _ => None,
                    };
                    for element in to.iter() {
                        if let Some(session) = &sessions[element.0 as usize] {
                            let policy = core.config().ack_policies[element.0 as usize];
                            let mark = record.filter(|_| policy == starfish_core::AckPolicy::NetworkSync);
                            let _ = session.frames.send((frame.clone(), mark));
                        }
                    }
                }
                Action::Disconnect { element } => {
                    // Dropping the session closes its socket; its link task reports back.
                    sessions[element.0 as usize] = None;
                }
                Action::Reply { token, reply } => {
                    if let Some(tx) = waiting.remove(&token) {
                        let _ = tx.send(reply);
                    }
                }
                Action::Event(event) => {
                    match &event {
                        Event::Superseded { seen, .. } => {
                            let _ = superseded.send(*seen);
                        }
                        Event::VolumeResized { volume, .. } => {
                            let _ = volume_events.send(VolumeEvent::Resized(*volume));
                        }
                        Event::VolumeCreated { volume } => {
                            let _ = volume_events.send(VolumeEvent::Created(*volume));
                        }
                        Event::VolumeRemoved { volume, everywhere } => {
                            let _ =
                                volume_events.send(VolumeEvent::Removed { volume: *volume, everywhere: *everywhere });
                        }
                        Event::Restarted { .. } => {
                            publish_exports(&exports, &core);
                            let _ = volume_events.send(VolumeEvent::Restarted { generation: core.takeovers() });
                        }
                        _ => {}
                    }
                    log_event(&core, &names, event)
                }
            }
        }
    }
}

fn handle_input(
    core: &mut HostCore,
    origin: Instant,
    input: Input,
    sessions: &mut [Option<Session>],
    waiting: &mut HashMap<Token, oneshot::Sender<Reply>>,
    next_token: &mut u64,
    exports: &Exports,
) {
    let t = now(origin);
    match input {
        Input::Host { volume, request, reply } => {
            *next_token += 1;
            let token = Token(*next_token);
            waiting.insert(token, reply);
            let volume = proto::VolumeId(volume);
            match request {
                Request::Read { offset_bytes, length_bytes, snapshot: None } => {
                    core.handle_host_read(t, token, volume, offset_bytes, length_bytes)
                }
                Request::Read { offset_bytes, length_bytes, snapshot: Some(s) } => {
                    core.handle_host_snapshot_read(t, token, volume, s, offset_bytes, length_bytes)
                }
                Request::Write(op) => core.handle_host_write(t, token, volume, op),
                Request::Flush => core.handle_host_flush(t, token, volume),
                Request::BlockStatus { offset_bytes, length_bytes, snapshot: None } => {
                    core.handle_host_block_status(t, token, volume, offset_bytes, length_bytes)
                }
                Request::BlockStatus { offset_bytes, length_bytes, snapshot: Some(s) } => {
                    core.handle_host_snapshot_block_status(t, token, volume, s, offset_bytes, length_bytes)
                }
            }
        }
        Input::Connected { element, session, frames, close } => {
            sessions[element.0 as usize] = Some(Session { id: session, frames, _close: close });
            core.handle_element_connected(t, element);
        }
        Input::Progress { element, session } => {
            if sessions[element.0 as usize].as_ref().is_some_and(|s| s.id == session) {
                core.handle_element_progress(t, element);
            }
        }
        Input::Sent { element, session, through } => {
            if sessions[element.0 as usize].as_ref().is_some_and(|s| s.id == session) {
                for (volume, sequence) in through {
                    core.handle_element_sent(t, element, volume, sequence);
                }
            }
        }
        Input::Message { element, session, message } => {
            if sessions[element.0 as usize].as_ref().is_some_and(|s| s.id == session) {
                core.handle_element_message(t, element, message);
            }
        }
        Input::Disconnected { element, session, reason } => {
            let current = sessions[element.0 as usize].as_ref().map(|s| s.id);
            if current == Some(session) {
                sessions[element.0 as usize] = None;
            }
            // The core hears about every session end exactly once (sessions that never
            // connected are reported with id 0 and only refresh the failure reason).
            if current == Some(session) || current.is_none() {
                core.handle_element_disconnected(t, element, &reason);
            }
        }
        Input::AddVolumes { added, reply } => {
            let result = core.add_volumes(t, added);
            publish_exports(exports, core);
            let _ = reply.send(result);
        }
        Input::CheckVolumes { specs, reply } => {
            *next_token += 1;
            let token = Token(*next_token);
            waiting.insert(token, reply);
            core.check_volumes(t, token, specs);
        }
        Input::RestartWithVolumes { added, shrunk, joined, grown, reply } => {
            let result = core.restart_with_volumes(t, added, &shrunk, &joined, &grown);
            publish_exports(exports, core);
            let _ = reply.send(result);
        }
        Input::JoinGroup { member, reply } => {
            let result = core.join_group(t, member);
            publish_exports(exports, core);
            let _ = reply.send(result);
        }
        Input::LeaveGroup { name, reply } => {
            let result = core.leave_group(&name);
            publish_exports(exports, core);
            let _ = reply.send(result);
        }
        Input::RemoveVolumes { names, reply } => {
            let result = core.remove_volumes(t, names);
            publish_exports(exports, core);
            let _ = reply.send(result);
        }
        Input::ResizeVolume { name, storage_bytes, size_bytes, reply } => {
            let result = core.resize_volume(t, &name, storage_bytes, size_bytes);
            publish_exports(exports, core);
            let _ = reply.send(result);
        }
        Input::AddSnapshotExport { name, of, snapshot, size_bytes, reply } => {
            let result = core.add_snapshot_export(name, &of, snapshot, size_bytes);
            publish_exports(exports, core);
            let _ = reply.send(result);
        }
        Input::RemoveSnapshotExport { name, reply } => {
            core.remove_snapshot_export(&name);
            publish_exports(exports, core);
            let _ = reply.send(());
        }
        // Unwrapped (or dropped) by the actor.
        Input::Guarded { .. } => {}
        Input::Status { reply } => {
            let _ = reply.send(core.status(t));
        }
        Input::Scrub { volume, rate_bytes_per_s, reply } => {
            let result = match core.volume_id(&volume) {
                Some(id) => core.start_scrub(t, id, rate_bytes_per_s),
                None => Err(format!("no volume {volume:?} (see starfish status)")),
            };
            let _ = reply.send(result);
        }
        Input::Release { reply } => {
            let frame = proto::encode_host_frame(&proto::HostMessage::Release);
            for session in sessions.iter().flatten() {
                let _ = session.frames.send((frame.clone(), None));
            }
            let _ = reply.send(());
        }
    }
}

/// One line per core event, inside a `host` span that names the epoch; lines about an element
/// say where it stands (`applied`: `volume@sequence`), lines about a volume its sequences.
fn log_event(core: &HostCore, names: &[String], event: Event) {
    let _host = tracing::info_span!("host", epoch = %core.epoch()).entered();
    let name = |e: ElementId| names[e.0 as usize].as_str();
    let volume_name = |v: proto::VolumeId| core.config().volumes[v.0 as usize].name.as_str();
    let applied = |e: ElementId| core.element_applied_text(e);
    match event {
        Event::Ready { volume, last } => {
            tracing::info!(volume = volume_name(volume), sequence = %last, "volume ready")
        }
        Event::VolumeCreated { volume } => {
            tracing::info!(volume = volume_name(volume), "volume created on a write quorum of elements")
        }
        Event::VolumeRemoved { volume, everywhere: false } => {
            tracing::info!(volume = volume_name(volume), "volume removed from every live element")
        }
        Event::VolumeRemoved { volume, everywhere: true } => {
            tracing::info!(volume = volume_name(volume), "volume removed from every element")
        }
        Event::VolumeResized { volume, size_bytes } => {
            tracing::info!(volume = volume_name(volume), size_bytes, "volume grown on a write quorum of elements")
        }
        Event::SnapshotReadRefused { volume, element, id, reason } => tracing::warn!(
            volume = volume_name(volume),
            element = name(element),
            snapshot = id,
            %reason,
            "an element could not read a snapshot; reading it from another"
        ),
        Event::ElementFailed { element, reason } => {
            tracing::warn!(element = name(element), applied = applied(element), %reason, "element failed")
        }
        Event::RecoveryStarted { element, kind, records, source, diverged } => tracing::info!(
            element = name(element),
            applied = applied(element),
            kind = kind.as_str(),
            records,
            source = source.map_or("host element write queue", name),
            diverged,
            "recovery started"
        ),
        Event::RecoveryProgress { element, message } => tracing::info!(element = name(element), "{message}"),
        Event::ElementInSync { element } => {
            tracing::info!(element = name(element), applied = applied(element), "element in sync")
        }
        Event::VolumeMode { volume: id, mode, in_sync } => {
            let volume = volume_name(id);
            let (acked, _) = core.volume_sequences(id);
            let acked = acked.0;
            match mode {
                starfish_core::VolumeMode::ReadOnly => tracing::error!(
                    volume,
                    acked,
                    in_sync,
                    quorum = core.config().quorum,
                    "volume is READ-ONLY: fewer in-sync elements than the write quorum; writes fail with EPERM until enough elements are back"
                ),
                starfish_core::VolumeMode::ReadWrite => {
                    tracing::info!(volume, acked, in_sync, "volume is read-write")
                }
                starfish_core::VolumeMode::Starting | starfish_core::VolumeMode::Unavailable => {
                    tracing::warn!(volume, acked, in_sync, mode = mode.as_str(), "volume is not serving")
                }
            }
        }
        Event::EpochRaised { from, to, refused_by } => tracing::info!(
            element = name(refused_by),
            from = %from,
            to = %to,
            "an element follows an epoch at least as new as ours: starting again with a newer epoch"
        ),
        Event::Restarted { from, to, refused_by, seen } => tracing::warn!(
            element = name(refused_by),
            from = %from,
            to = %to,
            seen = %seen,
            "an element follows an epoch whose host element is gone, and a majority follows ours or such epochs: taking the elements back with a newer epoch (requests under way fail; the catalog is read again)"
        ),
        Event::Superseded { ours, seen } => tracing::error!(
            ours = %ours,
            seen = %seen,
            "a majority of elements follow a newer host element's epoch: this host element was taken over and serves nothing more (every request fails with EIO); stop it"
        ),
        Event::BeginNotHeld { volume, sequence, held, reads } => tracing::warn!(
            volume = volume_name(volume),
            sequence = %sequence,
            held,
            quorum = core.config().quorum,
            reads,
            "reads served although fewer than Q elements hold this host element's beginning record: with ack policies weaker than durable, a later start without them could bring back a weakly acknowledged write that reads now do not show"
        ),
        Event::StartupTimedOut { welcomed, copying } => tracing::error!(
            welcomed,
            being_copied = copying,
            needed = core.start_minimum(),
            timeout_ms = core.config().startup_timeout_ms,
            "volumes UNAVAILABLE: too few elements that hold the volumes answered within the start-up timeout (one being copied holds nothing it acknowledged); requests fail with EIO until they do"
        ),
        Event::ScrubDone { volume, status } => {
            let f = &status.findings;
            let problems = f.blocks_mismatched + f.blocks_undecided + f.element_errors;
            let (volume, reason) = (volume_name(volume), status.reason.as_str());
            let (bytes, ms, repaired) = (status.done_bytes, status.elapsed_ms, f.repaired.join(","));
            if problems == 0 {
                tracing::info!(volume, reason, bytes, ms, compared = f.blocks_compared, changed = f.blocks_changed, "scrub done: the replicas agree");
            } else {
                tracing::warn!(
                    volume,
                    reason,
                    bytes,
                    ms,
                    compared = f.blocks_compared,
                    mismatched = f.blocks_mismatched,
                    undecided = f.blocks_undecided,
                    element_errors = f.element_errors,
                    last_error = f.last_error.as_deref().unwrap_or(""),
                    repaired,
                    "scrub done: replicas differed"
                );
            }
        }
        Event::Throttled { volume } => tracing::warn!(
            volume = volume_name(volume),
            acked = core.volume_sequences(volume).0 .0,
            last = core.volume_sequences(volume).1 .0,
            "write queue full: throttling new writes until the slowest element catches up"
        ),
    }
}

/// Reconnect backoff bounds, and how long a session must last to reset the backoff.
const BACKOFF_MAX: Duration = Duration::from_secs(2);
const SESSION_STABLE: Duration = Duration::from_secs(10);

/// An element that does not accept a connection within this is reported unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// While a frame from an element is still arriving, its progress is told the core this often.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// How an element is reached, for status: "tcp" or "udp-fec r=8 c=3 rate=100 Mbit/s" (and
/// "local socket" once a session went over it).
pub fn describe_link(far: Option<&crate::far_link::FarLinkOptions>) -> String {
    match far {
        None => "tcp".into(),
        Some(f) if f.rate_bytes_per_s == 0 => format!("udp-fec r={} c={} unpaced", f.r, f.c),
        Some(f) => format!("udp-fec r={} c={} rate={} Mbit/s", f.r, f.c, f.rate_bytes_per_s as f64 * 8.0 / 1e6),
    }
}

/// How one element is reached: its address, over the far link or not, whether its local
/// socket may be tried, and where the way its session went is told for status.
struct Route {
    address: SocketAddr,
    far: Option<crate::far_link::FarLinkOptions>,
    local: bool,
    links: Links,
}

/// Keep one session to an element: connect, pump frames both ways, reconnect with backoff.
async fn run_element_link(
    element: ElementId,
    route: Route,
    inputs: mpsc::UnboundedSender<Input>,
    tls: Option<crate::tls::TlsContext>,
) {
    let Route { address, far, local, links } = route;
    let mut session_id = (element.0 as u64) << 48;
    let mut backoff = Duration::from_millis(50);
    loop {
        let expected = &[crate::tls::Role::Element];
        let connected = match far {
            None => crate::tls::connect_element(address, tls.as_ref(), expected, CONNECT_TIMEOUT, local).await,
            Some(far) => crate::tls::connect_far(address, far, tls.as_ref(), expected, CONNECT_TIMEOUT).await,
        };
        match connected {
            Ok(stream) => {
                session_id += 1;
                let link = match stream.is_local() {
                    true => "local socket".to_string(),
                    false => describe_link(far.as_ref()),
                };
                if let Some(slot) = links.get(element.0 as usize) {
                    let mut slot = slot.lock().expect("link lock");
                    if *slot != link {
                        tracing::info!(element = element.0, %address, %link, "element reached over {link}");
                        *slot = link;
                    }
                }
                let opened = tokio::time::Instant::now();
                let (frames_tx, frames_rx) = mpsc::unbounded_channel();
                let (close_tx, close_rx) = oneshot::channel();
                if inputs
                    .send(Input::Connected { element, session: session_id, frames: frames_tx, close: close_tx })
                    .is_err()
                {
                    return;
                }
                let reason = run_session(element, session_id, stream, frames_rx, close_rx, &inputs).await;
                // Only a session that lasted resets the backoff: an element the host element
                // keeps refusing (say, one that needs full recovery) is not redialled 20 times
                // a second.
                if opened.elapsed() >= SESSION_STABLE {
                    backoff = Duration::from_millis(50);
                }
                if inputs.send(Input::Disconnected { element, session: session_id, reason }).is_err() {
                    return;
                }
            }
            Err(reason) => {
                if inputs.send(Input::Disconnected { element, session: 0, reason }).is_err() {
                    return;
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

async fn run_session(
    element: ElementId,
    session: u64,
    stream: crate::tls::Stream,
    mut frames: mpsc::UnboundedReceiver<Frame>,
    mut close: oneshot::Receiver<()>,
    inputs: &mpsc::UnboundedSender<Input>,
) -> String {
    // Over the far link, a network-sync element's records count once they are protected on
    // the wire (every data and repair packet of their FEC groups has left), not when written.
    let far = stream.far_progress();
    let mut lender = stream.lender();
    let (marks_tx, mut marks_rx) = mpsc::unbounded_channel::<(u64, Vec<(proto::VolumeId, proto::Sequence)>)>();
    let (mut read_half, write_half) = tokio::io::split(stream);
    let marker = async {
        let Some(far) = &far else { return std::future::pending::<String>().await };
        while let Some((offset, through)) = marks_rx.recv().await {
            if !far.protected(offset).await {
                break;
            }
            let _ = inputs.send(Input::Sent { element, session, through });
        }
        std::future::pending::<String>().await
    };
    let far_written = far.clone();
    let writer = async move {
        let mut out = write_half;
        let mut queue = Outgoing::new();
        let mut sent: Vec<(proto::VolumeId, proto::Sequence)> = Vec::new();
        fn note(sent: &mut Vec<(proto::VolumeId, proto::Sequence)>, mark: Option<(proto::VolumeId, proto::Sequence)>) {
            if let Some((volume, sequence)) = mark {
                match sent.iter_mut().find(|(v, _)| *v == volume) {
                    Some(entry) => entry.1 = entry.1.max(sequence),
                    None => sent.push((volume, sequence)),
                }
            }
        }
        // The frames waiting are written together: a large write's data shared, not copied,
        // and sent in one call with its head and tail.
        while let Some((frame, mark)) = frames.recv().await {
            frame.pieces().for_each(|piece| queue.push(piece));
            note(&mut sent, mark);
            while !queue.is_full() {
                let Ok((frame, mark)) = frames.try_recv() else { break };
                frame.pieces().for_each(|piece| queue.push(piece));
                note(&mut sent, mark);
            }
            queue.write_to(&mut out, lender.as_mut()).await?;
            if !sent.is_empty() {
                let through = std::mem::take(&mut sent);
                match &far_written {
                    None => {
                        let _ = inputs.send(Input::Sent { element, session, through });
                    }
                    // Usually already out: the flush sent it unless the pacer holds it back.
                    Some(progress) if progress.protected_now() >= progress.written() => {
                        let _ = inputs.send(Input::Sent { element, session, through });
                    }
                    Some(progress) => {
                        let _ = marks_tx.send((progress.written(), through));
                    }
                }
            }
        }
        Ok::<(), std::io::Error>(())
    };
    let reader = async {
        let mut buf = BytesMut::with_capacity(256 * 1024);
        let mut progress_said = tokio::time::Instant::now();
        loop {
            let mut whole = false;
            loop {
                match decode_frame::<ElementMessage>(&mut buf) {
                    Ok(Some(message)) => {
                        whole = true;
                        if inputs.send(Input::Message { element, session, message }).is_err() {
                            return "host element stopping".to_string();
                        }
                    }
                    Ok(None) => break,
                    Err(e) => return format!("bad frame from element: {e}"),
                }
            }
            // A large frame trickling over a thin link is not silence (the heartbeat timeout
            // is shorter than a 32 MiB read reply takes at 10 Mbit/s).
            if whole {
                progress_said = tokio::time::Instant::now();
            } else if !buf.is_empty() && progress_said.elapsed() >= PROGRESS_EVERY {
                progress_said = tokio::time::Instant::now();
                let _ = inputs.send(Input::Progress { element, session });
            }
            if buf.capacity() - buf.len() < 64 * 1024 {
                buf.reserve(256 * 1024);
            }
            match read_half.read_buf(&mut buf).await {
                Ok(0) => return "element closed the connection".to_string(),
                Ok(_) => {}
                Err(e) => return format!("read error: {e}"),
            }
        }
    };
    tokio::select! {
        reason = reader => reason,
        result = writer => match result {
            Ok(()) => "closed by the host element".to_string(),
            Err(e) => format!("write error: {e}"),
        },
        _ = &mut close => "closed by the host element".to_string(),
        reason = marker => reason,
    }
}

struct HostBackend {
    inputs: mpsc::UnboundedSender<Input>,
    /// Each exported volume, with its storage volume and where in it the volume starts (a
    /// consistency group's members are windows of the group's storage volume).
    exports: Exports,
    clients: Clients,
    metrics: crate::metrics::HostMetrics,
}

impl HostBackend {
    /// `future`, whose answer is measured: latency, bytes moved, error.
    fn timed<T: Send + 'static>(
        &self,
        export: &str,
        op: &'static str,
        bytes: u64,
        future: BoxFuture<Result<T, nbd::Errno>>,
    ) -> BoxFuture<Result<T, nbd::Errno>> {
        let (metrics, started) = (self.metrics.volume(export), Instant::now());
        Box::pin(async move {
            let result = future.await;
            // "EIO: input/output error" → "EIO".
            let error = result.as_ref().err().map(|e| e.to_string().split(':').next().unwrap_or("?").to_string());
            metrics.request(op, bytes, started.elapsed(), error);
            result
        })
    }

    /// Hand `request`, with offsets in `export`, to the core: `None` if the export is gone or
    /// the range lies past its end as it is now (the NBD layer checked it against the size
    /// the client was told at its handshake; the export may have shrunk since). The exports
    /// stay locked until the request is queued, so that it reaches the core before a resize
    /// that shrinks the export does (and before the zeroing of what lies past the new end).
    fn call(&self, export: &str, request: Request) -> Option<oneshot::Receiver<Reply>> {
        let exports = self.exports.read().expect("exports lock");
        let e = exports.get(export)?;
        let (offset_bytes, length_bytes) = match &request {
            Request::Read { offset_bytes, length_bytes, .. } => (*offset_bytes, *length_bytes as u64),
            Request::BlockStatus { offset_bytes, length_bytes, .. } => (*offset_bytes, *length_bytes),
            Request::Write(op) => (op.offset_bytes(), op.length_bytes()),
            Request::Flush => (0, 0),
        };
        if offset_bytes.checked_add(length_bytes).is_none_or(|end| end > e.size_bytes) {
            return None;
        }
        // A snapshot's export takes reads only (NBD refuses its writes before they get here).
        if e.snapshot.is_some() && matches!(request, Request::Write(_)) {
            return None;
        }
        let (volume, base, snapshot) = (e.volume as u32, e.offset_bytes, e.snapshot);
        let request = match request {
            Request::Read { offset_bytes, length_bytes, .. } => {
                Request::Read { offset_bytes: base + offset_bytes, length_bytes, snapshot }
            }
            Request::BlockStatus { offset_bytes, length_bytes, .. } => {
                Request::BlockStatus { offset_bytes: base + offset_bytes, length_bytes, snapshot }
            }
            // Only the catalog task sends these, not NBD.
            Request::Write(op @ (Op::Snapshot { .. } | Op::SnapshotDelete { .. })) => Request::Write(op),
            // Only the host core appends beginnings.
            Request::Write(Op::Begin) => return None,
            Request::Write(Op::WriteZeroes { offset_bytes, length_bytes }) => {
                Request::Write(Op::WriteZeroes { offset_bytes: base + offset_bytes, length_bytes })
            }
            Request::Write(Op::Trim { offset_bytes, length_bytes }) => {
                Request::Write(Op::Trim { offset_bytes: base + offset_bytes, length_bytes })
            }
            // The base is a whole number of blocks: the pieces and their checksums stay.
            Request::Write(Op::Write { offset_bytes, data, crcs }) => {
                Request::Write(Op::Write { offset_bytes: base + offset_bytes, data, crcs })
            }
            Request::Flush => Request::Flush,
        };
        let (reply, rx) = oneshot::channel();
        self.inputs.send(Input::Host { volume, request, reply }).ok()?;
        drop(exports);
        Some(rx)
    }
}

fn errno(error: HostError) -> nbd::Errno {
    match error {
        HostError::ReadOnly => nbd::Errno::Perm,
        HostError::QuorumLost | HostError::Unavailable => nbd::Errno::Io,
    }
}

fn done(rx: Option<oneshot::Receiver<Reply>>) -> BoxFuture<Result<(), nbd::Errno>> {
    Box::pin(async move {
        match rx.ok_or(nbd::Errno::Io)?.await {
            Ok(Reply::Done(result)) => result.map_err(errno),
            _ => Err(nbd::Errno::Io),
        }
    })
}

impl Backend for HostBackend {
    fn opened(&self, export: &str) -> Result<(), String> {
        self.clients.lock().expect("clients lock").open(export)
    }

    fn closed(&self, export: &str) {
        self.clients.lock().expect("clients lock").end(export);
    }

    fn unknown(&self, export: &str) -> Option<String> {
        self.clients.lock().expect("clients lock").closed_reason(export)
    }

    fn exports(&self) -> Vec<ExportInfo> {
        let exports = self.exports.read().expect("exports lock");
        exports
            .list()
            .iter()
            .map(|e| {
                let description = match (&e.group, e.snapshot) {
                    (_, Some(_)) => format!("StarFish snapshot {} (read-only)", e.name),
                    (Some(group), None) => format!("StarFish volume {} (consistency group {group})", e.name),
                    (None, None) => format!("StarFish volume {}", e.name),
                };
                let read_only = e.snapshot.is_some();
                ExportInfo { name: e.name.clone(), size_bytes: e.size_bytes, description, read_only }
            })
            .collect()
    }

    fn read(&self, export: &str, offset_bytes: u64, length_bytes: u32) -> BoxFuture<Result<Bytes, nbd::Errno>> {
        let rx = self.call(export, Request::Read { offset_bytes, length_bytes, snapshot: None });
        let future: BoxFuture<Result<Bytes, nbd::Errno>> = Box::pin(async move {
            match rx.ok_or(nbd::Errno::Io)?.await {
                Ok(Reply::Read(result)) => result.map_err(errno),
                _ => Err(nbd::Errno::Io),
            }
        });
        self.timed(export, "read", length_bytes as u64, future)
    }

    fn write(&self, export: &str, offset_bytes: u64, data: Bytes, _fua: bool) -> BoxFuture<Result<(), nbd::Errno>> {
        // The piece checksums are computed here, once, as the write arrives: they travel with
        // it to every element's disk, and reads are checked against them. Pieces are cut at
        // block boundaries of the storage volume (a group member starts on one).
        let bytes = data.len() as u64;
        let future = done(self.call(export, Request::Write(Op::write(offset_bytes, data))));
        self.timed(export, "write", bytes, future)
    }

    fn write_zeroes(
        &self,
        export: &str,
        offset_bytes: u64,
        length_bytes: u64,
        _fua: bool,
    ) -> BoxFuture<Result<(), nbd::Errno>> {
        let future = done(self.call(export, Request::Write(Op::WriteZeroes { offset_bytes, length_bytes })));
        self.timed(export, "write_zeroes", 0, future)
    }

    fn trim(
        &self,
        export: &str,
        offset_bytes: u64,
        length_bytes: u64,
        _fua: bool,
    ) -> BoxFuture<Result<(), nbd::Errno>> {
        let future = done(self.call(export, Request::Write(Op::Trim { offset_bytes, length_bytes })));
        self.timed(export, "trim", 0, future)
    }

    fn flush(&self, export: &str) -> BoxFuture<Result<(), nbd::Errno>> {
        self.timed(export, "flush", 0, done(self.call(export, Request::Flush)))
    }

    fn block_status(
        &self,
        export: &str,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> BoxFuture<Result<Vec<Extent>, nbd::Errno>> {
        let rx = self.call(export, Request::BlockStatus { offset_bytes, length_bytes, snapshot: None });
        let future: BoxFuture<Result<Vec<Extent>, nbd::Errno>> = Box::pin(async move {
            match rx.ok_or(nbd::Errno::Io)?.await {
                Ok(Reply::BlockStatus(result)) => Ok(result
                    .map_err(errno)?
                    .into_iter()
                    .map(|e| Extent { length_bytes: e.length_bytes, hole: !e.allocated })
                    .collect()),
                _ => Err(nbd::Errno::Io),
            }
        });
        self.timed(export, "block_status", 0, future)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(name: &str, volume: usize) -> ExportedVolume {
        ExportedVolume { name: name.into(), group: None, volume, offset_bytes: 0, size_bytes: 4096, snapshot: None }
    }

    #[test]
    fn an_export_closes_only_without_clients_and_refuses_new_ones_until_reopened() {
        let mut table = ClientTable::default();
        assert_eq!(table.open("a"), Ok(()));
        assert_eq!(table.open("a"), Ok(()));
        assert_eq!(table.close("a", "a is going".into()), Err(NotClosed::Connected(2)));
        table.end("a");
        assert_eq!(table.close("a", "a is going".into()), Err(NotClosed::Connected(1)));
        table.end("a");
        assert!(table.connected.is_empty());
        assert_eq!(table.close("a", "a is going".into()), Ok(()));
        // Closed: a new client hears why, and is not counted; a second operation is refused.
        assert_eq!(table.open("a"), Err("a is going".into()));
        assert_eq!(table.closed_reason("a"), Some("a is going".into()));
        assert!(table.connected.is_empty());
        assert_eq!(table.close("a", "a shrinks".into()), Err(NotClosed::Closing("a is going".into())));
        // Other exports are untouched.
        assert_eq!(table.open("b"), Ok(()));
        assert_eq!(table.connected.get("b"), Some(&1));
        assert_eq!(table.closed_reason("b"), None);
        table.reopen("a");
        assert_eq!(table.closed_reason("a"), None);
        assert_eq!(table.open("a"), Ok(()));
        assert_eq!(table.connected.get("a"), Some(&1));
    }

    #[test]
    fn exports_are_found_by_name_and_listed_in_order() {
        let names: Vec<String> = (0..1000).map(|i| format!("vol{i}")).collect();
        let table = ExportTable::new(names.iter().enumerate().map(|(i, n)| export(n, i)).collect());
        for (i, name) in names.iter().enumerate() {
            assert_eq!(table.get(name).map(|e| e.volume), Some(i), "{name}");
        }
        assert!(table.get("vol1000").is_none() && table.get("").is_none());
        assert_eq!(table.list().iter().map(|e| e.name.as_str()).collect::<Vec<_>>(), names);
    }

    #[test]
    fn of_two_exports_of_one_name_the_first_is_found() {
        let table = ExportTable::new(vec![export("a", 0), export("b", 1), export("a", 2)]);
        assert_eq!(table.get("a").map(|e| e.volume), Some(0));
        assert_eq!(table.list().len(), 3);
    }
}
