//! The catalog task of an active host element (issue 15). At start-up it reads the catalog
//! (`starfish_core::catalog`): the volumes created while earlier host elements ran are served
//! from the start (the core starts over with them, once, before NBD serves anything), and the
//! intentions they left are finished. Then it carries out `starfish volume create` through the
//! intention log — check that every live element has room, log the intention (one catalog
//! write and a FLUSH, shared by the creations of a group commit), add the volume to the core
//! and the NBD exports, answer once Q elements hold it, write the completion — and
//! `starfish volume delete`: refuse a volume in use, log the intention (the same write drops
//! the volume's entry), remove it from the core and the exports (the elements are told, those
//! that are down by their next hello), answer once every live element removed it, and write
//! the completion once every configured element did; and `starfish volume resize` (grow): check
//! that every live element has room for the growth, log the intention, grow the volume in the
//! core and the NBD exports (elements grow their storage in their stream), answer once Q
//! elements hold the new size, write the completion. It answers `starfish volume list`. The
//! decisions are the core's (`IntentionLog`, `HostCore::add_volumes`,
//! `HostCore::remove_volumes`, `HostCore::resize_volume`); this is their I/O.
//!
//! A core that takes the elements back from a host element that is gone (`Event::Restarted`)
//! serves the configured volumes only: that one may have created, deleted or grown volumes
//! since this one read the catalog. The task then answers every operation under way (its
//! outcome is the catalog's), and reads the catalog again as at start-up. What it sends the
//! core goes through a handle guarded by the core's count of takeovers, so nothing decided
//! from the older read reaches the core after.
//!
//! Snapshots (`starfish snapshot create/delete/list`) go the same way: the intention is logged,
//! then the snapshot's record is sent in its volume's ordered stream (again until a write
//! quorum holds it: an element that holds the snapshot already takes nothing), then the
//! completion lists it and NBD exports it read-only as `VOLUME@NAME`. A deletion stops the
//! export, sends its record, and completes. A starting host element exports the listed
//! snapshots and sends the records of pending ones again.
//!
//! Failpoints for the crash tests: `STARFISH_FAILPOINT=volume-create:after-intention`,
//! `…:after-add` or `…:before-completion` aborts the process at that step of a creation;
//! `volume-delete:after-intention`, `…:after-remove` or `…:before-completion` of a deletion;
//! `volume-resize:after-intention`, `…:after-resize` or `…:before-completion` of a resize;
//! `snapshot-create:after-intention`, `…:after-record` or `…:before-completion` of a
//! snapshot, and the same steps of `snapshot-delete`. At an `after-intention` step, and at a
//! snapshot's `after-record`, `STEP=sleep(MS)` holds the operation there for MS milliseconds
//! instead.
//!
//! A deletion (of a volume or a snapshot) and a shrink close their exports to new NBD
//! connections from their check that none is connected until they are answered: a client
//! that asks meanwhile is refused (`NBD_REP_ERR_UNKNOWN`, "… is being deleted"), also once the
//! export is removed. A deletion found pending at start-up closes its exports too (a group
//! snapshot's: each member's `M@NAME`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use proto::{Op, VolumeId};
use serde_json::{json, Value};
use starfish_core::catalog::{self, Catalog, CatalogSnapshot, Intent, Intention, IntentionLog, LogPolicy};
use starfish_core::{HostError, Reply, Time};
use tokio::sync::{mpsc, oneshot, watch};

use crate::host::{ClosedToClients, HostHandle, NotClosed, Request, VolumeEvent};

/// How long a creation waits for Q elements to hold the volume before it answers anyway.
const CREATE_WAIT: Duration = Duration::from_secs(30);
/// How long after a failed catalog write the next is tried.
const RETRY_WAIT: Duration = Duration::from_millis(200);
/// How often start-up looks whether the core serves yet.
const POLL: Duration = Duration::from_millis(20);
/// How long a deletion or a shrink waits for the NBD connections to its volume to end before
/// it is refused as in use (a client that just disconnected is counted out a moment later).
/// From then until it is answered, the export is closed to new connections.
const CLOSING_WAIT: Duration = Duration::from_secs(1);
/// A shrink zeroes the blocks past the new end in writes of at most this many bytes.
const ZERO_CHUNK_BYTES: u64 = 1 << 30;
/// How long a shrink's zeroing waits before it tries again a write that failed (the volume
/// lost its write quorum).
const ZERO_RETRY_WAIT: Duration = Duration::from_secs(1);

pub(crate) enum VolumeOrder {
    /// `group`: join this consistency group (`--group`).
    Create {
        name: String,
        size_bytes: u64,
        group: Option<String>,
        reply: oneshot::Sender<Result<Value, String>>,
    },
    Delete {
        name: String,
        with_snapshots: bool,
        reply: oneshot::Sender<Result<Value, String>>,
    },
    Resize {
        name: String,
        size_bytes: u64,
        shrink: bool,
        reply: oneshot::Sender<Result<Value, String>>,
    },
    Clone {
        snapshot: String,
        name: String,
        reply: oneshot::Sender<Result<Value, String>>,
    },
    List {
        reply: oneshot::Sender<Result<Value, String>>,
    },
    /// `group`: `volume` names a consistency group (`--group`).
    SnapshotCreate {
        volume: String,
        name: String,
        group: bool,
        reply: oneshot::Sender<Result<Value, String>>,
    },
    SnapshotDelete {
        volume: String,
        name: String,
        reply: oneshot::Sender<Result<Value, String>>,
    },
    SnapshotList {
        reply: oneshot::Sender<Result<Value, String>>,
    },
}

/// A snapshot being taken or deleted (logged, or found pending at start-up).
struct Snapshotting {
    snapshot: CatalogSnapshot,
    delete: bool,
    reply: Option<oneshot::Sender<Result<Value, String>>>,
    /// A deletion's exports of the snapshot, closed to new NBD connections while this lasts.
    #[allow(dead_code)] // held: dropping it lets clients in again
    closed: Vec<ClosedToClients>,
    asked: Instant,
    /// Its record is on its way (the answer waits for a write quorum to hold it).
    sent: bool,
}

/// An operation whose intention's write failed: its reply, the reason, and when.
type Undoing = (oneshot::Sender<Result<Value, String>>, String, Instant);

/// A deletion under way (logged, or found pending at start-up).
struct Deleting {
    name: String,
    /// Its storage volume on the elements.
    storage: String,
    reply: Option<oneshot::Sender<Result<Value, String>>>,
    /// The volume's export (and, with `--with-snapshots`, its snapshots' exports) closed to new
    /// NBD connections while this lasts.
    #[allow(dead_code)] // held: dropping it lets clients in again
    closed: Vec<ClosedToClients>,
    /// Its placeholder in the core, once removed there.
    volume: Option<VolumeId>,
    asked: Instant,
    /// Every live element removed it (the answer is due).
    removed_live: bool,
    /// A member that joined a consistency group: its window of the group's storage volume
    /// (from, to), zeroed before the deletion completes.
    window: Option<(u64, u64)>,
}

/// A resize under way (logged, or waiting for its prepare).
struct Resizing {
    name: String,
    storage: String,
    size_bytes: u64,
    /// A shrink: the blocks past the new end are being zeroed once `volume` is set.
    shrink: bool,
    reply: Option<oneshot::Sender<Result<Value, String>>>,
    /// A shrink's export, closed to new NBD connections while this lasts.
    #[allow(dead_code)] // held: dropping it lets clients in again
    closed: Option<ClosedToClients>,
    /// Its storage volume in the core, once resized there.
    volume: Option<VolumeId>,
    asked: Instant,
}

/// A creation under way.
struct Creating {
    name: String,
    size_bytes: u64,
    /// A clone: the snapshot's export name (`VOLUME@NAME`).
    clone_of: Option<String>,
    /// A member joining this consistency group.
    group: Option<String>,
    reply: Option<oneshot::Sender<Result<Value, String>>>,
    /// Its storage volume in the core, once added (a joining member's: its group's).
    volume: Option<VolumeId>,
    asked: Instant,
}

struct Catalogue {
    handle: HostHandle,
    origin: Instant,
    /// The catalog's storage volume in the core.
    volume: u32,
    log: IntentionLog,
    creating: BTreeMap<u64, Creating>,
    deleting: BTreeMap<u64, Deleting>,
    resizing: BTreeMap<u64, Resizing>,
    snapshotting: BTreeMap<u64, Snapshotting>,
    /// Volumes created while running that this host element serves: name → storage volume.
    created: BTreeMap<String, String>,
    /// The catalog could not be read: what is wrong (creations are refused).
    broken: Option<String>,
    writes: mpsc::UnboundedSender<Result<(), String>>,
    writing: bool,
    /// A catalog write failed: the next is not tried before this.
    retry_at: Option<Instant>,
    /// Operations whose intention's write failed, answered once the write that undoes them
    /// is durable (until then a starting host element might still carry them out).
    undoing: BTreeMap<u64, Undoing>,
    checked: mpsc::UnboundedSender<Checked>,
    /// A shrink's zeroing is done (its intention's id) or could not go on (the host element
    /// is stopping, or this pass ended).
    zeroed: mpsc::UnboundedSender<(u64, Result<(), String>)>,
    /// A snapshot's record (its intention's id) is held by a write quorum from the sequence
    /// given on, or could not be sent (the host element is stopping, or this pass ended).
    recorded: mpsc::UnboundedSender<(u64, Result<u64, String>)>,
}

/// A creation's (or a resize's) prepare, answered.
struct Checked {
    resize: bool,
    shrink: bool,
    /// A clone's creation: the snapshot's export name.
    clone_of: Option<String>,
    /// A join: the group, its storage volume, and where its members end now.
    join: Option<(String, String, u64)>,
    name: String,
    size_bytes: u64,
    reply: oneshot::Sender<Result<Value, String>>,
    result: Result<(), String>,
    /// A shrink's export, closed to new NBD connections since its checks.
    closed: Option<ClosedToClients>,
}

pub(crate) async fn run(
    handle: HostHandle,
    policy: LogPolicy,
    mut orders: mpsc::UnboundedReceiver<VolumeOrder>,
    mut events: mpsc::UnboundedReceiver<VolumeEvent>,
    loaded: watch::Sender<bool>,
) {
    let mut generation = 0;
    // One pass per start of the core: at start-up, and again after each takeover.
    while let Some(next) = serve(handle.guarded(generation), policy, &mut orders, &mut events, &loaded).await {
        tracing::warn!(
            "this host element took the elements back from one that is gone: reading the catalog again (that one may have changed it)"
        );
        generation = next;
    }
}

/// Read the catalog, serve its volumes, finish its intentions and carry out volume operations
/// until the core takes the elements back from a host element that is gone (`Some` of the
/// core's takeovers then: read the catalog again) or the host element stops (`None`).
async fn serve(
    handle: HostHandle,
    policy: LogPolicy,
    orders: &mut mpsc::UnboundedReceiver<VolumeOrder>,
    events: &mut mpsc::UnboundedReceiver<VolumeEvent>,
    loaded: &watch::Sender<bool>,
) -> Option<u64> {
    // Channels of this pass: what an earlier pass's tasks answer late goes nowhere.
    let (writes, mut written) = mpsc::unbounded_channel();
    let (checked, mut checked_rx) = mpsc::unbounded_channel();
    let (zeroed, mut zeroed_rx) = mpsc::unbounded_channel();
    let (recorded, mut recorded_rx) = mpsc::unbounded_channel();
    let volume = wait_serving(&handle).await?;
    let (catalog, broken) = match read_catalog(&handle, volume).await {
        Ok(catalog) => (catalog, None),
        Err(reason) => {
            tracing::error!(
                "the catalog of volumes created while running cannot be read: {reason}; serving the configured volumes only, and refusing volume operations"
            );
            (Catalog::default(), Some(reason))
        }
    };
    let mut c = Catalogue {
        handle,
        origin: Instant::now(),
        volume,
        log: IntentionLog::new(catalog.clone(), policy),
        creating: BTreeMap::new(),
        deleting: BTreeMap::new(),
        resizing: BTreeMap::new(),
        snapshotting: BTreeMap::new(),
        created: BTreeMap::new(),
        broken,
        writes,
        writing: false,
        retry_at: None,
        undoing: BTreeMap::new(),
        checked,
        zeroed,
        recorded,
    };
    if c.broken.is_none() {
        c.start(catalog).await;
    }
    let _ = loaded.send(true);
    loop {
        c.write_if_due();
        let deadline = c.log.deadline().map(|t| c.origin + Duration::from_micros(t.0));
        let next_wait = c
            .creating
            .values()
            .filter(|k| k.reply.is_some())
            .map(|k| k.asked)
            .chain(c.deleting.values().filter(|d| d.reply.is_some()).map(|d| d.asked))
            .chain(c.resizing.values().filter(|r| r.reply.is_some() && r.volume.is_some()).map(|r| r.asked))
            .chain(c.snapshotting.values().filter(|s| s.reply.is_some() && s.sent).map(|s| s.asked))
            .chain(c.undoing.values().map(|(_, _, at)| *at))
            .map(|asked| asked + CREATE_WAIT)
            .min();
        let wake = deadline.into_iter().chain(next_wait).chain(c.retry_at).min();
        let sleep = async {
            match wake {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            order = orders.recv() => match order {
                Some(VolumeOrder::Create { name, size_bytes, group, reply }) => c.create(name, size_bytes, group, reply).await,
                Some(VolumeOrder::Delete { name, with_snapshots, reply }) => c.delete(name, with_snapshots, reply).await,
                Some(VolumeOrder::Clone { snapshot, name, reply }) => c.clone(snapshot, name, reply),
                Some(VolumeOrder::Resize { name, size_bytes, shrink, reply }) => {
                    c.resize(name, size_bytes, shrink, reply).await
                }
                Some(VolumeOrder::List { reply }) => {
                    let _ = reply.send(Ok(c.list()));
                }
                Some(VolumeOrder::SnapshotCreate { volume, name, group, reply }) => {
                    c.snapshot(volume, name, group, reply).await
                }
                Some(VolumeOrder::SnapshotDelete { volume, name, reply }) => {
                    c.snapshot_delete(volume, name, reply).await
                }
                Some(VolumeOrder::SnapshotList { reply }) => {
                    let _ = reply.send(Ok(c.list_snapshots()));
                }
                None => return None,
            },
            Some(event) = events.recv() => match event {
                VolumeEvent::Created(volume) => c.on_created(volume),
                VolumeEvent::Removed { volume, everywhere } => c.on_removed(volume, everywhere),
                VolumeEvent::Resized(volume) => c.on_resized(volume),
                VolumeEvent::Restarted { generation } => {
                    c.abandon();
                    // Prepares answered but not yet taken: their operators are told too.
                    while let Ok(checked) = checked_rx.try_recv() {
                        let _ = checked.reply.send(Err(ABANDONED_UNLOGGED.to_string()));
                    }
                    return Some(generation);
                }
            },
            Some(result) = written.recv() => c.on_written(result).await,
            Some(checked) = checked_rx.recv() => c.on_checked(checked).await,
            Some((id, result)) = zeroed_rx.recv() => c.on_zeroed(id, result),
            Some((id, result)) = recorded_rx.recv() => c.on_recorded(id, result).await,
            _ = sleep => c.answer_slow(),
        }
    }
}

/// What the operator hears of an operation under way when the core took the elements back
/// (`Event::Restarted`).
const ABANDONED: &str = "the host element took the elements back from one that is gone and started over: the operation may or may not be carried out (the catalog decides: see starfish volume list)";

/// ... before it was even logged: nothing was done.
const ABANDONED_UNLOGGED: &str = "the host element took the elements back from one that is gone and started over before the operation was logged: nothing was done; ask again";

/// Whether export `e` is member `M`'s `M@NAME` of consistency group `group`'s snapshot `name`.
fn is_member_snapshot(e: &starfish_core::groups::ExportedVolume, group: &str, name: &str) -> bool {
    e.group.as_deref() == Some(group) && e.name.rsplit_once('@').is_some_and(|(_, s)| s == name)
}

/// The export names of `snapshot`, exported or not (a starting host element does not export
/// one being deleted): `VOLUME@NAME`, or for a consistency group's each member's `M@NAME`.
fn snapshot_exports(exports: &[starfish_core::groups::ExportedVolume], snapshot: &CatalogSnapshot) -> Vec<String> {
    let group = &snapshot.volume;
    let members = exports.iter().filter(|e| e.snapshot.is_none() && e.group.as_deref() == Some(group.as_str()));
    let mut names: Vec<String> = members.map(|m| format!("{}@{}", m.name, snapshot.name)).collect();
    if names.is_empty() {
        names.push(snapshot.export_name());
    }
    names
}

/// The storage volume and size of consistency group `group` (from its members' exports), if
/// there is one by that name.
fn group_storage(exports: &[starfish_core::groups::ExportedVolume], group: &str) -> Option<(usize, u64)> {
    let members = exports.iter().filter(|e| e.snapshot.is_none() && e.group.as_deref() == Some(group));
    let storage = members.clone().next()?.volume;
    Some((storage, members.map(|e| e.offset_bytes + e.size_bytes).max().unwrap_or(0)))
}

/// Hand a prepare's answer to the catalog task's pass that asked; if that pass ended (the
/// core took the elements back), the operator is told so.
fn answer_checked(checked: &mpsc::UnboundedSender<Checked>, answer: Checked) {
    if let Err(mpsc::error::SendError(answer)) = checked.send(answer) {
        let _ = answer.reply.send(Err(ABANDONED_UNLOGGED.to_string()));
    }
}

/// Wait until the core serves the catalog's storage volume read-write (its start-up decision
/// made, Q elements in sync): only then is what it reads durable on Q elements, so that no
/// later host element can find an older catalog. Below quorum the catalog is not read (the
/// configured volumes are served meanwhile).
async fn wait_serving(handle: &HostHandle) -> Option<u32> {
    loop {
        let status = handle.status().await?;
        if status.ready {
            let at = status.volumes.iter().position(|v| v.name == catalog::CATALOG_VOLUME);
            let at = at.expect("the catalog volume is configured by start_active");
            if status.volumes[at].mode == starfish_core::VolumeMode::ReadWrite {
                return Some(at as u32);
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The catalog document, read through the core (retried while the volume cannot serve).
async fn read_catalog(handle: &HostHandle, volume: u32) -> Result<Catalog, String> {
    let first = read(handle, volume, 0, proto::BLOCK_BYTES as u32).await?;
    let Some(total) = Catalog::stored_bytes(&first)? else { return Ok(Catalog::default()) };
    let mut document = first.to_vec();
    let mut at = proto::BLOCK_BYTES;
    while at < total {
        let n = (total - at).min(proto::PAYLOAD_BYTES_MAX as u64) as u32;
        document.extend_from_slice(&read(handle, volume, at, n).await?);
        at += n as u64;
    }
    Catalog::decode(&document)
}

async fn read(handle: &HostHandle, volume: u32, offset_bytes: u64, length_bytes: u32) -> Result<Bytes, String> {
    let mut said = false;
    loop {
        match handle.storage_request(volume, Request::Read { offset_bytes, length_bytes, snapshot: None }).await {
            Some(Reply::Read(Ok(data))) => return Ok(data),
            Some(Reply::Read(Err(e))) => {
                if !said {
                    tracing::warn!(error = ?e, "the catalog cannot be read yet; retrying");
                    said = true;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            _ => return Err("host element stopping".into()),
        }
    }
}

/// What a client that asks for `what` ("volume v", "snapshot v@s") hears while it is being
/// deleted.
fn deleting(what: &str) -> String {
    format!("{what} is being deleted")
}

/// What a client that asks for volume `name` hears while it is being shrunk to `size_bytes`.
fn shrinking(name: &str, size_bytes: u64) -> String {
    format!("volume {name} is being shrunk to {size_bytes} bytes")
}

impl Catalogue {
    fn now(&self) -> Time {
        Time(self.origin.elapsed().as_micros() as u64)
    }

    /// Close `export` to new NBD connections (a client is told `reason`) for an operation that
    /// must have none, once the connections to it have ended: it waits up to [`CLOSING_WAIT`]
    /// for them (a client that just disconnected may not be counted out yet). `Err`: why not,
    /// for the operator, naming the export as `what` ("volume v", "snapshot v@s"), or naming
    /// the operation under way that closed it.
    async fn close_to_clients(&self, export: &str, what: &str, reason: String) -> Result<ClosedToClients, String> {
        let until = Instant::now() + CLOSING_WAIT;
        loop {
            match self.handle.close_to_clients(export, reason.clone()) {
                Ok(closed) => return Ok(closed),
                Err(NotClosed::Closing(other)) => return Err(format!("{other}; try again once that is answered")),
                Err(NotClosed::Connected(clients)) if Instant::now() >= until => {
                    return Err(format!("{what} is in use by {clients} NBD connection(s); disconnect them first"))
                }
                Err(NotClosed::Connected(_)) => tokio::time::sleep(POLL).await,
            }
        }
    }

    /// Close every export of `exports` (name, and what it is: "volume v", "snapshot v@s") to
    /// be deleted, as [`Self::close_to_clients`] does: all of them, or none (those closed
    /// already open again as the guards drop) and why not.
    async fn close_for_deletion(&self, exports: &[(String, String)]) -> Result<Vec<ClosedToClients>, String> {
        let mut closed = Vec::with_capacity(exports.len());
        for (export, what) in exports {
            closed.push(self.close_to_clients(export, what, deleting(what)).await?);
        }
        Ok(closed)
    }

    /// Close `export` to new NBD connections for an operation found pending at start-up, which
    /// must finish whatever: a client connected already (none should be: clients wait until the
    /// catalog is read) is logged, not waited for.
    fn close_at_start(&self, export: &str, reason: String) -> Option<ClosedToClients> {
        match self.handle.close_to_clients(export, reason) {
            Ok(closed) => Some(closed),
            Err(why) => {
                tracing::warn!(export, ?why, "a pending operation could not close its export to new NBD connections");
                None
            }
        }
    }

    /// Serve the catalog's volumes (starting the core over with them, once) and finish the
    /// intentions it holds.
    async fn start(&mut self, catalog: Catalog) {
        let serve = catalog.volumes_to_serve();
        let removed = catalog.removed_to_serve();
        let restart = catalog.volumes_to_restart();
        let members = catalog.members_to_serve();
        let grown = catalog.groups_grown();
        if !restart.is_empty() || !members.is_empty() || !grown.is_empty() {
            let joined_names = members.iter().map(|m| m.name.as_str());
            let names: Vec<&str> = serve.iter().map(|(n, _)| n.as_str()).chain(joined_names).collect();
            tracing::info!(volumes = %names.join(", "), "serving the volumes created while running");
            if !removed.is_empty() {
                tracing::info!(volumes = %removed.join(", "), "finishing deletions: every element is told to remove these");
            }
            let joined = members.clone();
            let shrunk = catalog.exports_shrunk();
            if let Err(reason) = self.handle.restart_with_volumes(restart, shrunk, joined, grown).await {
                tracing::error!("cannot serve the volumes of the catalog: {reason}");
                self.broken = Some(reason);
                return;
            }
            let Some(volume) = wait_serving(&self.handle).await else { return };
            self.volume = volume;
            self.created.extend(serve.iter().map(|(name, spec)| (name.clone(), spec.name.clone())));
            self.created.extend(members.iter().map(|m| (m.name.clone(), m.storage.clone())));
        }
        for snapshot in &catalog.snapshots {
            self.export_snapshot(snapshot).await;
        }
        let now = self.now();
        let status = self.handle.status().await;
        for intention in &catalog.intentions {
            if let Some(snapshot) = intention.snapshot() {
                let delete = matches!(intention.op, Intent::SnapshotDelete { .. });
                let (what, name) = (if delete { "deletion" } else { "taking" }, snapshot.export_name());
                tracing::info!(id = intention.id, "finishing the {what} of snapshot {name}: sending its record again");
                let closed = match delete {
                    true => snapshot_exports(&self.handle.exports(), snapshot)
                        .into_iter()
                        .filter_map(|export| self.close_at_start(&export, deleting(&format!("snapshot {export}"))))
                        .collect(),
                    false => Vec::new(),
                };
                let snapshot = snapshot.clone();
                let snapshotting =
                    Snapshotting { snapshot, delete, reply: None, closed, asked: Instant::now(), sent: false };
                self.snapshotting.insert(intention.id, snapshotting);
                self.send_record(intention.id);
                continue;
            }
            let volume = intention.volume();
            if intention.is_create() {
                tracing::info!(id = intention.id, "finishing the creation of {} (rolled forward)", volume.name);
                self.log.finish(now, intention.id, true);
                continue;
            }
            if intention.is_shrink() {
                // Served at the new size from the start; what lies past it is zeroed again
                // (what the crashed host element wrote of it may be anywhere), then completed.
                let storage = volume.spec().name;
                let at = status.as_ref().and_then(|s| s.volumes.iter().position(|v| v.name == storage));
                let Some(at) = at else {
                    tracing::error!(storage = %storage, "a pending shrink names a volume that is not served; left pending");
                    continue;
                };
                tracing::info!(
                    id = intention.id,
                    size_bytes = volume.size_bytes,
                    "finishing the shrink of {} (rolled forward): zeroing what lies past its new end",
                    volume.name
                );
                let reason = shrinking(&volume.name, volume.size_bytes);
                let resizing = Resizing {
                    name: volume.name.clone(),
                    storage,
                    size_bytes: volume.size_bytes,
                    shrink: true,
                    reply: None,
                    closed: self.close_at_start(&volume.name, reason),
                    volume: Some(VolumeId(at as u32)),
                    asked: Instant::now(),
                };
                self.resizing.insert(intention.id, resizing);
                self.zero_tail(intention.id, at as u32, volume.size_bytes, volume.storage_bytes);
                continue;
            }
            if intention.is_resize() {
                // Served at the new size from the start: every element grows it as its hello
                // names it so.
                tracing::info!(
                    id = intention.id,
                    size_bytes = volume.size_bytes,
                    "finishing the resize of {} (rolled forward)",
                    volume.name
                );
                self.log.finish(now, intention.id, true);
                continue;
            }
            // Rolled forward: its placeholder tells every element; the completion is written
            // once all removed it. A group's member: its window is zeroed again, then the
            // completion is written.
            let storage = volume.spec().name;
            let placeholder = status
                .as_ref()
                .and_then(|s| s.volumes.iter().position(|v| v.name == storage))
                .map(|i| VolumeId(i as u32));
            let window = volume.window();
            if let (Some((from, to)), Some(at)) = (window, placeholder) {
                tracing::info!(id = intention.id, storage = %storage, "finishing the deletion of {} (rolled forward): zeroing its window of its group", volume.name);
                self.zero_tail(intention.id, at.0, from, to);
            } else if window.is_some() {
                tracing::error!(storage = %storage, "a pending deletion names a group member whose group is not served; left pending");
                continue;
            }
            tracing::info!(id = intention.id, storage = %storage, "finishing the deletion of {} (rolled forward)", volume.name);
            let closed =
                self.close_at_start(&volume.name, deleting(&format!("volume {}", volume.name))).into_iter().collect();
            let deleting = Deleting {
                name: volume.name,
                storage,
                reply: None,
                closed,
                volume: placeholder,
                asked: Instant::now(),
                removed_live: false,
                window,
            };
            self.deleting.insert(intention.id, deleting);
        }
    }

    /// `starfish volume delete`: checks, then the intention (or, with policy `none`, the
    /// deletion at once).
    async fn delete(&mut self, name: String, with_snapshots: bool, reply: oneshot::Sender<Result<Value, String>>) {
        if let Some(reason) = &self.broken {
            let _ = reply.send(Err(format!("volume operations are off: the catalog cannot be read ({reason})")));
            return;
        }
        if !self.created.contains_key(&name) {
            let configured =
                self.handle.exports().iter().any(|e| e.name == name || e.group.as_deref() == Some(name.as_str()));
            let reason = if self.deleting.values().any(|d| d.name == name) {
                format!("volume {name} is being deleted")
            } else if configured {
                format!("volume {name} is declared in the configuration (--volume or the TOML): remove it there, not while running")
            } else if self.creating.values().any(|k| k.name == name) {
                format!("volume {name} is being created; delete it once its creation is answered")
            } else {
                format!("no volume {name} (see starfish volume list)")
            };
            let _ = reply.send(Err(reason));
            return;
        }
        // Below the write quorum the intention cannot be logged: say so now.
        let writable = self.handle.status().await.and_then(|s| s.volumes.get(self.volume as usize).map(|v| v.mode));
        if writable != Some(starfish_core::VolumeMode::ReadWrite) {
            let reason = "read-only: fewer elements in sync than the write quorum; nothing was deleted";
            let _ = reply.send(Err(reason.to_string()));
            return;
        }
        // From here until it is answered, no new client gets in (dropped on a refusal below).
        let mut exports = vec![(name.clone(), format!("volume {name}"))];
        if with_snapshots {
            let prefix = format!("{name}@");
            let snapshots =
                self.handle.exports().into_iter().filter(|e| e.snapshot.is_some() && e.name.starts_with(&prefix));
            exports.extend(snapshots.map(|e| (e.name.clone(), format!("snapshot {}", e.name))));
        }
        let closed = match self.close_for_deletion(&exports).await {
            Ok(closed) => closed,
            Err(reason) => {
                let _ = reply.send(Err(reason));
                return;
            }
        };
        let now = self.now();
        match self.log.intend_delete(now, &name, with_snapshots) {
            Err(reason) => {
                let _ = reply.send(Err(reason));
            }
            Ok(intention) => {
                let volume = intention.volume();
                let window = volume.window();
                let deleting = Deleting {
                    name,
                    storage: volume.spec().name,
                    reply: Some(reply),
                    closed,
                    volume: None,
                    asked: Instant::now(),
                    removed_live: false,
                    window,
                };
                self.deleting.insert(intention.id, deleting);
                for unlogged in self.log.take_unlogged() {
                    self.execute(unlogged).await;
                }
            }
        }
    }

    /// `starfish volume resize`: checks, then the prepare (every live element has room for a
    /// storage volume that grows), then the intention.
    async fn resize(
        &mut self,
        name: String,
        size_bytes: u64,
        shrink: bool,
        reply: oneshot::Sender<Result<Value, String>>,
    ) {
        if let Some(reason) = &self.broken {
            let _ = reply.send(Err(format!("volume operations are off: the catalog cannot be read ({reason})")));
            return;
        }
        let Some(storage) = self.created.get(&name).cloned() else {
            let configured =
                self.handle.exports().iter().any(|e| e.name == name || e.group.as_deref() == Some(name.as_str()));
            let reason = if self.deleting.values().any(|d| d.name == name) {
                format!("volume {name} is being deleted")
            } else if configured {
                format!("volume {name} is declared in the configuration (--volume or the TOML): give it its new size there and restart the host element (the elements grow it)")
            } else if self.creating.values().any(|k| k.name == name) {
                format!("volume {name} is being created; resize it once its creation is answered")
            } else {
                format!("no volume {name} (see starfish volume list)")
            };
            let _ = reply.send(Err(reason));
            return;
        };
        if self.resizing.values().any(|r| r.name == name) {
            let _ = reply.send(Err(format!("volume {name} is being resized; wait for that to be answered")));
            return;
        }
        let member = self.log.catalog().volumes.iter().find(|v| v.name == name).and_then(|v| v.member_of.clone());
        if let Some(w) = member {
            let _ = reply.send(Err(catalog::member_resize_refusal(&name, &w.group)));
            return;
        }
        if self.log.policy() == LogPolicy::None {
            let reason = "a resize must be logged: start the host element with --intention-log group or single";
            let _ = reply.send(Err(reason.into()));
            return;
        }
        let current = self.handle.exports().iter().find(|e| e.name == name).map_or(0, |e| e.size_bytes);
        if let Err(reason) = catalog::check_size(size_bytes) {
            let _ = reply.send(Err(reason));
            return;
        }
        if let Err(reason) = catalog::check_resize(&name, current, size_bytes, shrink) {
            let _ = reply.send(Err(reason));
            return;
        }
        // A shrink: from here until it is answered, no new client gets in (dropped on a refusal
        // below). Clients of the old size could write past the new end.
        let closed = match shrink {
            false => None,
            true => match self.close_to_clients(&name, &format!("volume {name}"), shrinking(&name, size_bytes)).await {
                Ok(closed) => Some(closed),
                Err(reason) => {
                    let _ = reply.send(Err(format!("{reason} (a shrink is refused while the export is in use)")));
                    return;
                }
            },
        };
        let writable = self.handle.status().await.and_then(|s| s.volumes.get(self.volume as usize).map(|v| v.mode));
        if writable != Some(starfish_core::VolumeMode::ReadWrite) {
            let reason = "read-only: fewer elements in sync than the write quorum; nothing was resized";
            let _ = reply.send(Err(reason.to_string()));
            return;
        }
        let stored = self.log.catalog().volumes.iter().find(|v| v.name == name).map_or(0, |v| v.storage_bytes);
        if size_bytes <= stored {
            // Within the storage volume: nothing to prepare on the elements.
            let checked = Checked {
                resize: true,
                shrink,
                clone_of: None,
                join: None,
                name,
                size_bytes,
                reply,
                result: Ok(()),
                closed,
            };
            return self.on_checked(checked).await;
        }
        // Prepare: the elements count the growth of a volume they hold.
        let spec = proto::VolumeSpec { name: storage, size_bytes, clone_of: None, at_least: false };
        let (handle, checked) = (self.handle.clone(), self.checked.clone());
        tokio::spawn(async move {
            let result = handle.check_volumes(vec![spec]).await;
            let checked_answer =
                Checked { resize: true, shrink, clone_of: None, join: None, name, size_bytes, reply, result, closed };
            answer_checked(&checked, checked_answer);
        });
    }

    async fn create(
        &mut self,
        name: String,
        size_bytes: u64,
        group: Option<String>,
        reply: oneshot::Sender<Result<Value, String>>,
    ) {
        match group {
            None => self.create_volume(name, size_bytes, None, reply),
            Some(group) => self.join(name, size_bytes, group, reply).await,
        }
    }

    /// Why volume `name` of `size_bytes` cannot be created (or join a group), if it cannot.
    fn creation_refusal(&self, name: &str, size_bytes: u64) -> Option<String> {
        if let Some(reason) = &self.broken {
            return Some(format!("volume operations are off: the catalog cannot be read ({reason})"));
        }
        let exports = self.handle.exports();
        if exports.iter().any(|e| e.name == name || e.group.as_deref() == Some(name)) {
            return Some(format!("a volume named {name} exists"));
        }
        catalog::check_name(name).and_then(|()| catalog::check_size(size_bytes)).err()
    }

    /// `starfish volume create NAME SIZE --group GROUP`: checks, then the prepare (every live
    /// element has room for the group's storage volume to grow by the new member), then the
    /// intention (see `catalog::IntentionLog::intend_join`).
    async fn join(
        &mut self,
        name: String,
        size_bytes: u64,
        group: String,
        reply: oneshot::Sender<Result<Value, String>>,
    ) {
        if let Some(reason) = self.creation_refusal(&name, size_bytes) {
            let _ = reply.send(Err(reason));
            return;
        }
        let exports = self.handle.exports();
        let Some((index, members_end)) = group_storage(&exports, &group) else {
            let _ = reply.send(Err(format!(
                "no consistency group {group} (see starfish status): groups are declared at start-up (--group NAME:VOL,VOL), and a volume created while running may join one"
            )));
            return;
        };
        let storage =
            self.handle.status().await.and_then(|s| s.volumes.get(index).map(|v| (v.name.clone(), v.size_bytes)));
        let Some((storage, storage_bytes)) = storage else {
            let _ = reply.send(Err("host element stopping".to_string()));
            return;
        };
        // Prepare: the elements count the growth of the group's storage volume (where the
        // member will lie is decided when its intention is logged; this is where it would lie
        // now).
        let window = self.log.catalog().join_window(&group, &storage, members_end, size_bytes, |_| false);
        let Some((_, needs)) = window else {
            let _ = reply.send(Err(catalog::group_too_large(&group)));
            return;
        };
        let grown = needs.max(storage_bytes);
        let spec = proto::VolumeSpec { name: storage.clone(), size_bytes: grown, clone_of: None, at_least: true };
        let (handle, checked) = (self.handle.clone(), self.checked.clone());
        let join = Some((group, storage, members_end));
        tokio::spawn(async move {
            let result = handle.check_volumes(vec![spec]).await;
            let answer = Checked {
                resize: false,
                shrink: false,
                clone_of: None,
                join,
                name,
                size_bytes,
                reply,
                result,
                closed: None,
            };
            answer_checked(&checked, answer);
        });
    }

    /// `starfish volume clone VOLUME@NAME NEW`: a creation of the snapshot's size whose
    /// intention names the snapshot (see `catalog::IntentionLog::intend_clone`).
    fn clone(&mut self, snapshot: String, name: String, reply: oneshot::Sender<Result<Value, String>>) {
        if let Some(reason) = &self.broken {
            let _ = reply.send(Err(format!("volume operations are off: the catalog cannot be read ({reason})")));
            return;
        }
        let exports = self.handle.exports();
        let of_group = exports.iter().any(|e| e.snapshot.is_some() && e.name == snapshot && e.group.is_some())
            || snapshot.rsplit_once('@').is_some_and(|(g, _)| group_storage(&exports, g).is_some());
        if of_group {
            let _ = reply.send(Err(format!(
                "{snapshot} is a snapshot of a consistency group: clones of a group's snapshot are not supported yet"
            )));
            return;
        }
        match self.log.listed_snapshot(&snapshot) {
            Ok(base) => self.create_volume(name, base.size_bytes, Some(snapshot), reply),
            Err(reason) => {
                let _ = reply.send(Err(reason));
            }
        }
    }

    fn create_volume(
        &mut self,
        name: String,
        size_bytes: u64,
        clone_of: Option<String>,
        reply: oneshot::Sender<Result<Value, String>>,
    ) {
        if let Some(reason) = self.creation_refusal(&name, size_bytes) {
            let _ = reply.send(Err(reason));
            return;
        }
        // Prepare: every live element has room (nothing is logged for a creation that cannot
        // be carried out). The checks of several creations run side by side; each comes back
        // to the loop through `checked`.
        let probe = catalog::storage_name(&name, 0);
        // A clone is checked as one (its blocks are its snapshot's until it writes).
        let base = clone_of.as_ref().and_then(|export| {
            let snapshots = &self.log.catalog().snapshots;
            let s = snapshots.iter().find(|s| &s.export_name() == export)?;
            Some(proto::CloneBase { volume: s.storage_volume(), snapshot: s.id })
        });
        let spec = proto::VolumeSpec { name: probe.clone(), size_bytes, clone_of: base, at_least: false };
        let (handle, checked) = (self.handle.clone(), self.checked.clone());
        tokio::spawn(async move {
            let result = handle.check_volumes(vec![spec]).await.map_err(|reason| reason.replace(&probe, &name));
            answer_checked(
                &checked,
                Checked {
                    resize: false,
                    shrink: false,
                    clone_of,
                    join: None,
                    name,
                    size_bytes,
                    reply,
                    result,
                    closed: None,
                },
            );
        });
    }

    /// A creation's prepare answered: log its intention (or, with policy `none`, carry it out).
    async fn on_checked(&mut self, checked: Checked) {
        let Checked { resize, shrink, clone_of, join, name, size_bytes, reply, result, closed } = checked;
        if let Err(reason) = result {
            let _ = reply.send(Err(reason));
            return;
        }
        let now = self.now();
        if resize {
            match self.log.intend_resize(now, &name, size_bytes, shrink) {
                Err(reason) => {
                    let _ = reply.send(Err(reason));
                }
                Ok(intention) => {
                    let storage = intention.volume().spec().name;
                    let asked = Instant::now();
                    let reply = Some(reply);
                    let resizing = Resizing { name, storage, size_bytes, shrink, reply, closed, volume: None, asked };
                    self.resizing.insert(intention.id, resizing);
                }
            }
            return;
        }
        let intended = match (&clone_of, &join) {
            (_, Some((group, storage, end))) => self.log.intend_join(now, &name, size_bytes, group, storage, *end),
            (None, None) => self.log.intend_create(now, &name, size_bytes),
            (Some(snapshot), None) => self.log.intend_clone(now, snapshot, &name),
        };
        match intended {
            Err(reason) => {
                let _ = reply.send(Err(reason));
            }
            Ok(intention) => {
                let (asked, group, reply) = (Instant::now(), join.map(|(group, _, _)| group), Some(reply));
                let creating = Creating { name, size_bytes, clone_of, group, reply, volume: None, asked };
                self.creating.insert(intention.id, creating);
                for unlogged in self.log.take_unlogged() {
                    self.execute(unlogged).await;
                }
            }
        }
    }

    /// Write the catalog if a write is due and none is under way.
    fn write_if_due(&mut self) {
        if self.writing || self.retry_at.is_some_and(|at| Instant::now() < at) {
            return;
        }
        self.retry_at = None;
        let now = self.now();
        let Some(write) = self.log.poll_write(now) else { return };
        self.writing = true;
        let (handle, volume, done) = (self.handle.clone(), self.volume, self.writes.clone());
        tokio::spawn(async move {
            let data = Bytes::from(write.document);
            let result = match handle.storage_request(volume, Request::Write(Op::write(0, data))).await {
                Some(Reply::Done(Ok(()))) => match handle.storage_request(volume, Request::Flush).await {
                    Some(Reply::Done(Ok(()))) => Ok(()),
                    Some(Reply::Done(Err(e))) => Err(describe(e)),
                    _ => Err("host element stopping".into()),
                },
                Some(Reply::Done(Err(e))) => Err(describe(e)),
                _ => Err("host element stopping".into()),
            };
            let _ = done.send(result);
        });
    }

    async fn on_written(&mut self, result: Result<(), String>) {
        self.writing = false;
        match result {
            Ok(()) => {
                let logged = self.log.written();
                for (id, done) in self.log.take_durable() {
                    if let (false, Some((reply, reason, _))) = (done, self.undoing.remove(&id)) {
                        let _ =
                            reply.send(Err(format!("the catalog could not be written: {reason}; nothing was done")));
                    }
                }
                for intention in logged {
                    failpoint_or_pause(&format!("{}:after-intention", step_prefix(&intention))).await;
                    self.execute(intention).await;
                }
            }
            Err(reason) => {
                tracing::error!("the catalog could not be written: {reason}; retrying");
                self.retry_at = Some(Instant::now() + RETRY_WAIT);
                for intention in self.log.write_failed() {
                    let id = intention.id;
                    let reply = match self.creating.remove(&id) {
                        Some(mut k) => k.reply.take(),
                        None => match self.deleting.remove(&id) {
                            Some(mut d) => d.reply.take(),
                            None => match self.resizing.remove(&id) {
                                Some(mut r) => r.reply.take(),
                                None => self.snapshotting.remove(&id).and_then(|mut s| s.reply.take()),
                            },
                        },
                    };
                    if let Some(reply) = reply {
                        self.undoing.insert(intention.id, (reply, reason.clone(), Instant::now()));
                    }
                }
            }
        }
    }

    /// Carry out a logged (or, with policy `none`, unlogged) creation: the core adds the
    /// volume and tells the elements; NBD exports it.
    async fn execute(&mut self, intention: Intention) {
        if intention.is_snapshot() {
            return self.execute_snapshot(intention).await;
        }
        if intention.is_delete() {
            return self.execute_delete(intention).await;
        }
        if intention.is_resize() {
            return self.execute_resize(intention).await;
        }
        let volume = intention.volume();
        let spec = volume.spec();
        let added = match volume.joined() {
            Some(member) => self.handle.join_group(member).await,
            None => self.handle.add_volumes(vec![(volume.name.clone(), spec.clone())]).await.map(|ids| ids[0]),
        };
        match added {
            Ok(id) => {
                failpoint("volume-create:after-add");
                if let Some(k) = self.creating.get_mut(&intention.id) {
                    k.volume = Some(id);
                }
                self.created.insert(volume.name.clone(), spec.name.clone());
                tracing::info!(volume = %volume.name, storage = %spec.name, "volume created; waiting for a write quorum of elements to hold it");
            }
            Err(reason) => {
                // Undone: the intention is cleared with the next write.
                tracing::warn!(volume = %volume.name, "volume creation undone: {reason}");
                let now = self.now();
                if self.log.policy() != LogPolicy::None {
                    self.log.finish(now, intention.id, false);
                }
                if let Some(mut k) = self.creating.remove(&intention.id) {
                    if let Some(reply) = k.reply.take() {
                        let _ = reply.send(Err(reason));
                    }
                }
            }
        }
    }

    /// Carry out a logged (or unlogged) deletion: the core removes the volume and tells the
    /// elements; NBD stops exporting it.
    async fn execute_delete(&mut self, intention: Intention) {
        let volume = intention.volume();
        let storage = volume.spec().name;
        let window = volume.window();
        let removed = match window {
            Some(_) => self.handle.leave_group(volume.name.clone()).await,
            None => self.handle.remove_volumes(vec![storage.clone()]).await.map(|ids| ids[0]),
        };
        match removed {
            Ok(id) => {
                failpoint("volume-delete:after-remove");
                self.created.remove(&volume.name);
                if let Some(d) = self.deleting.get_mut(&intention.id) {
                    d.volume = Some(id);
                }
                if let Some((from, to)) = window {
                    // A group's member: its window is zeroed through the group's stream.
                    tracing::info!(volume = %volume.name, storage = %storage, "volume deleted; zeroing its window of its group");
                    return self.zero_tail(intention.id, id.0, from, to);
                }
                tracing::info!(volume = %volume.name, storage = %storage, "volume deleted; waiting for the elements to remove it");
            }
            Err(reason) => {
                // Undone: the volume is listed again with the next write.
                tracing::warn!(volume = %volume.name, "volume deletion undone: {reason}");
                let now = self.now();
                if self.log.policy() == LogPolicy::None {
                    self.log.finish_unlogged(now, volume.clone());
                } else {
                    self.log.finish(now, intention.id, false);
                }
                if let Some(reply) = self.deleting.remove(&intention.id).and_then(|mut d| d.reply.take()) {
                    let _ = reply.send(Err(reason));
                }
            }
        }
    }

    /// Carry out a logged resize: the core resizes the volume (telling the elements if its
    /// storage volume grows); NBD exports the new size to clients that connect from now on.
    async fn execute_resize(&mut self, intention: Intention) {
        let volume = intention.volume();
        let storage = volume.spec().name;
        match self.handle.resize_volume(storage.clone(), volume.storage_bytes, volume.size_bytes).await {
            Ok(id) => {
                failpoint("volume-resize:after-resize");
                if let Some(r) = self.resizing.get_mut(&intention.id) {
                    r.volume = Some(id);
                    r.asked = Instant::now();
                }
                tracing::info!(volume = %volume.name, size_bytes = volume.size_bytes, "volume resized; waiting for a write quorum of elements to hold the new size");
            }
            Err(reason) => {
                tracing::warn!(volume = %volume.name, "volume resize undone: {reason}");
                let now = self.now();
                self.log.finish(now, intention.id, false);
                if let Some(reply) = self.resizing.remove(&intention.id).and_then(|mut r| r.reply.take()) {
                    let _ = reply.send(Err(reason));
                }
            }
        }
    }

    /// Q elements hold a resized volume at its new size (or, within its storage volume, it is
    /// exported at its new size): answer, and complete its intention. A shrink first zeroes
    /// what lies past its new end.
    fn on_resized(&mut self, volume: VolumeId) {
        // Members joining a group whose storage volume Q elements now hold grown.
        let joined: Vec<u64> = self
            .creating
            .iter()
            .filter(|(_, k)| k.group.is_some() && k.volume == Some(volume))
            .map(|(id, _)| *id)
            .collect();
        for id in joined {
            self.finish_create(id);
        }
        let Some((&id, r)) = self.resizing.iter().find(|(_, r)| r.volume == Some(volume)) else { return };
        if r.shrink {
            let stored = self.log.catalog().intentions.iter().find(|i| i.id == id).map(|i| i.volume().storage_bytes);
            let Some(stored) = stored else { return };
            let size_bytes = r.size_bytes;
            return self.zero_tail(id, volume.0, size_bytes, stored);
        }
        self.finish_resize(id);
    }

    /// Zero storage volume `volume` from `from_bytes` to `to_bytes` in the background, in the
    /// ordered stream (every element applies it after every write before it; one that is down
    /// gets it by recovery), then FLUSH it (durable on Q elements); then `on_zeroed`. A write
    /// that fails (the volume lost its write quorum) is tried again until it succeeds.
    fn zero_tail(&self, id: u64, volume: u32, from_bytes: u64, to_bytes: u64) {
        let (handle, zeroed) = (self.handle.clone(), self.zeroed.clone());
        tokio::spawn(async move {
            let result = zero(&handle, volume, from_bytes, to_bytes).await;
            let _ = zeroed.send((id, result));
        });
    }

    /// A shrink's (or a group member's deletion's) zeroing is done: answer, and complete its
    /// intention.
    fn on_zeroed(&mut self, id: u64, result: Result<(), String>) {
        if let Err(reason) = result {
            tracing::warn!(id, "a zeroing stopped: {reason}; the next host element to start finishes it");
            return;
        }
        if let Some(mut d) = self.deleting.remove(&id) {
            failpoint("volume-delete:before-completion");
            let now = self.now();
            self.log.finish(now, id, true);
            if let Some(reply) = d.reply.take() {
                let _ = reply.send(Ok(describe_deleted(id, &d.name, &d.storage, self.log.policy(), true, false)));
            }
            return;
        }
        self.finish_resize(id);
    }

    /// A resize carried out: answer, and complete its intention.
    fn finish_resize(&mut self, id: u64) {
        let Some(r) = self.resizing.remove(&id) else { return };
        failpoint("volume-resize:before-completion");
        let now = self.now();
        self.log.finish(now, id, true);
        if let Some(reply) = r.reply {
            let _ = reply.send(Ok(describe_resized(id, &r.name, &r.storage, r.size_bytes, self.log.policy(), true)));
        }
    }

    /// Every live element (`everywhere`: every element) removed a deleted volume: answer;
    /// once everywhere, complete its intention.
    fn on_removed(&mut self, volume: VolumeId, everywhere: bool) {
        let Some((&id, _)) = self.deleting.iter().find(|(_, d)| d.volume == Some(volume)) else { return };
        let d = self.deleting.get_mut(&id).expect("found");
        d.removed_live = true;
        if let Some(reply) = d.reply.take() {
            let doc = describe_deleted(id, &d.name, &d.storage, self.log.policy(), true, everywhere);
            let _ = reply.send(Ok(doc));
        }
        if everywhere {
            failpoint("volume-delete:before-completion");
            self.deleting.remove(&id);
            let now = self.now();
            self.log.finish(now, id, true);
        }
    }

    /// Q elements hold a created volume: answer, and complete its intention.
    fn on_created(&mut self, volume: VolumeId) {
        let Some((&id, _)) = self.creating.iter().find(|(_, k)| k.volume == Some(volume)) else { return };
        self.finish_create(id);
    }

    /// Creation `id` carried out: answer, and complete its intention.
    fn finish_create(&mut self, id: u64) {
        let mut k = self.creating.remove(&id).expect("found");
        failpoint("volume-create:before-completion");
        let now = self.now();
        if self.log.policy() == LogPolicy::None {
            let listed = catalog::CatalogVolume::new(k.name.clone(), k.size_bytes, id);
            self.log.finish_unlogged(now, listed);
        } else {
            self.log.finish(now, id, true);
        }
        if let Some(reply) = k.reply.take() {
            let _ = reply.send(Ok(self.describe_created(id, &k, true)));
        }
    }

    /// The core took the elements back from a host element that is gone: every operation
    /// under way is answered (the next pass reads the catalog and finishes what it holds).
    fn abandon(&mut self) {
        let replies = self
            .creating
            .values_mut()
            .filter_map(|k| k.reply.take())
            .chain(self.deleting.values_mut().filter_map(|d| d.reply.take()))
            .chain(self.resizing.values_mut().filter_map(|r| r.reply.take()))
            .chain(self.snapshotting.values_mut().filter_map(|s| s.reply.take()))
            .chain(std::mem::take(&mut self.undoing).into_values().map(|(reply, _, _)| reply));
        for reply in replies {
            let _ = reply.send(Err(ABANDONED.to_string()));
        }
    }

    /// Creations that waited `CREATE_WAIT` for Q elements are answered (the volume stays:
    /// elements create it as they answer, or when they come back).
    fn answer_slow(&mut self) {
        let late: Vec<u64> = self
            .creating
            .iter()
            .filter(|(_, k)| k.volume.is_some() && k.reply.is_some() && k.asked.elapsed() >= CREATE_WAIT)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            let doc = self.describe_created(id, &self.creating[&id], false);
            if let Some(reply) = self.creating.get_mut(&id).and_then(|k| k.reply.take()) {
                let _ = reply.send(Ok(doc));
            }
        }
        // An operation whose intention's write failed, and whose undoing cannot be written
        // either (the quorum is still lost): the operator is told the outcome is not known yet.
        let stuck: Vec<u64> =
            self.undoing.iter().filter(|(_, (_, _, at))| at.elapsed() >= CREATE_WAIT).map(|(id, _)| *id).collect();
        for id in stuck {
            let (reply, reason, _) = self.undoing.remove(&id).expect("listed");
            let _ = reply.send(Err(format!(
                "the catalog could not be written ({reason}): the operation is undone once it can be written again; a host element that starts before then may still carry it out"
            )));
        }
        let policy = self.log.policy();
        for (&id, r) in self.resizing.iter_mut() {
            if r.volume.is_some() && r.asked.elapsed() >= CREATE_WAIT {
                if let Some(reply) = r.reply.take() {
                    let _ = reply.send(Ok(describe_resized(id, &r.name, &r.storage, r.size_bytes, policy, false)));
                }
            }
        }
        for (&id, d) in self.deleting.iter_mut() {
            if d.volume.is_some() && d.asked.elapsed() >= CREATE_WAIT {
                if let Some(reply) = d.reply.take() {
                    let _ = reply.send(Ok(describe_deleted(id, &d.name, &d.storage, policy, false, false)));
                }
            }
        }
        for (&id, s) in self.snapshotting.iter_mut() {
            if s.sent && s.asked.elapsed() >= CREATE_WAIT {
                if let Some(reply) = s.reply.take() {
                    let _ = reply.send(Ok(describe_snapshot(id, &s.snapshot, s.delete, policy, false)));
                }
            }
        }
    }

    /// `starfish snapshot create VOLUME NAME`: checks, then the intention; its record is sent
    /// once it is logged ([`Catalogue::execute_snapshot`]).
    async fn snapshot(
        &mut self,
        volume: String,
        name: String,
        group: bool,
        reply: oneshot::Sender<Result<Value, String>>,
    ) {
        if let Some(reason) = &self.broken {
            let _ = reply.send(Err(format!("snapshots are off: the catalog cannot be read ({reason})")));
            return;
        }
        let exports = self.handle.exports();
        let target = match exports.iter().find(|e| e.name == volume && e.snapshot.is_none()) {
            Some(_) if group => Err(format!("{volume} is a volume, not a consistency group (see starfish volume list)")),
            Some(e) => match &e.group {
                Some(g) => Err(format!(
                    "volume {volume} is a member of consistency group {g}: snapshot the group, which takes all its volumes at one point (starfish snapshot create --group {g} NAME)"
                )),
                None => Ok((e.volume, e.size_bytes)),
            },
            // A consistency group: its storage volume, all its members at one point.
            None => match group_storage(&exports, &volume) {
                Some(storage) => Ok(storage),
                None if group => Err(format!("no consistency group {volume} (see starfish status)")),
                None if self.creating.values().any(|k| k.name == volume) => {
                    Err(format!("volume {volume} is being created; snapshot it once its creation is answered"))
                }
                None => Err(format!("no volume {volume} (see starfish volume list)")),
            },
        };
        let (storage, size_bytes) = match target {
            Ok(target) => target,
            Err(reason) => {
                let _ = reply.send(Err(reason));
                return;
            }
        };
        if let Err(reason) = self.check_writable(storage, "no snapshot was taken").await {
            let _ = reply.send(Err(reason));
            return;
        }
        let volume_id =
            self.created.get(&volume).map_or(catalog::CONFIGURED_VOLUME_ID, |storage| catalog::storage_id(storage));
        let now = self.now();
        match self.log.intend_snapshot(now, &volume, volume_id, &name, size_bytes) {
            Err(reason) => {
                let _ = reply.send(Err(reason));
            }
            Ok(intention) => {
                let snapshot = intention.snapshot().expect("a snapshot's intention").clone();
                let snapshotting = Snapshotting {
                    snapshot,
                    delete: false,
                    reply: Some(reply),
                    closed: Vec::new(),
                    asked: Instant::now(),
                    sent: false,
                };
                self.snapshotting.insert(intention.id, snapshotting);
            }
        }
    }

    /// `starfish snapshot delete VOLUME@NAME`: checks, then the intention (whose write drops
    /// the snapshot's entry).
    async fn snapshot_delete(&mut self, volume: String, name: String, reply: oneshot::Sender<Result<Value, String>>) {
        if let Some(reason) = &self.broken {
            let _ = reply.send(Err(format!("snapshots are off: the catalog cannot be read ({reason})")));
            return;
        }
        let exports = self.handle.exports();
        // A consistency group's snapshot is exported as each member's `M@NAME`: either names
        // the group's snapshot, `GROUP@NAME` in the catalog.
        let group = exports
            .iter()
            .find(|e| e.snapshot.is_some() && e.name == format!("{volume}@{name}"))
            .and_then(|e| e.group.clone())
            .or_else(|| group_storage(&exports, &volume).map(|_| volume.clone()));
        let volume = group.clone().unwrap_or(volume);
        let export = format!("{volume}@{name}");
        let exported: Vec<&starfish_core::groups::ExportedVolume> = exports
            .iter()
            .filter(|e| e.snapshot.is_some())
            .filter(|e| match &group {
                Some(g) => is_member_snapshot(e, g, &name),
                None => e.name == export,
            })
            .collect();
        let storage = exported.first().map(|e| e.volume);
        let Some(storage) = storage else {
            // Being taken (asked, or found pending by this host element at start-up): not
            // exported until a write quorum holds it. Being deleted: no longer exported.
            let pending = self.snapshotting.values().find(|s| s.snapshot.export_name() == export);
            let reason = match pending.map(|s| s.delete) {
                Some(false) => format!(
                    "snapshot {export} is being taken; delete it once that is answered (see starfish snapshot list)"
                ),
                Some(true) => format!("snapshot {export} is being deleted"),
                None => format!("no snapshot {export} (see starfish snapshot list)"),
            };
            let _ = reply.send(Err(reason));
            return;
        };
        // From here until it is answered, no new client gets in (dropped on a refusal below).
        let exports: Vec<(String, String)> =
            exported.iter().map(|e| (e.name.clone(), format!("snapshot {}", e.name))).collect();
        let closed = match self.close_for_deletion(&exports).await {
            Ok(closed) => closed,
            Err(reason) => {
                let _ = reply.send(Err(reason));
                return;
            }
        };
        if let Err(reason) = self.check_writable(storage, "no snapshot was deleted").await {
            let _ = reply.send(Err(reason));
            return;
        }
        let now = self.now();
        match self.log.intend_snapshot_delete(now, &volume, &name) {
            Err(reason) => {
                let _ = reply.send(Err(reason));
            }
            Ok(intention) => {
                let snapshot = intention.snapshot().expect("a snapshot's intention").clone();
                let snapshotting = Snapshotting {
                    snapshot,
                    delete: true,
                    reply: Some(reply),
                    closed,
                    asked: Instant::now(),
                    sent: false,
                };
                self.snapshotting.insert(intention.id, snapshotting);
            }
        }
    }

    /// `Ok` if the catalog's volume and storage volume `storage` take writes now (a snapshot's
    /// intention and record need both); else why not, saying that `nothing` was done.
    async fn check_writable(&self, storage: usize, nothing: &str) -> Result<(), String> {
        let status = self.handle.status().await;
        let mode = |i: usize| status.as_ref().and_then(|s| s.volumes.get(i).map(|v| v.mode));
        let writable = Some(starfish_core::VolumeMode::ReadWrite);
        if mode(self.volume as usize) != writable || mode(storage) != writable {
            return Err(format!("read-only: fewer elements in sync than the write quorum; {nothing}"));
        }
        Ok(())
    }

    /// Carry out a logged snapshot's intention: a deletion first stops the export; then the
    /// record goes out.
    async fn execute_snapshot(&mut self, intention: Intention) {
        let Some(s) = self.snapshotting.get(&intention.id) else { return };
        if s.delete {
            self.handle.remove_snapshot_export(s.snapshot.export_name()).await;
        }
        self.send_record(intention.id);
    }

    /// Send snapshot intention `id`'s record in its volume's ordered stream, again until a
    /// write quorum holds it, then a FLUSH; `on_recorded` hears the outcome.
    fn send_record(&mut self, id: u64) {
        let Some(s) = self.snapshotting.get_mut(&id) else { return };
        let exports = self.handle.exports();
        let of = &s.snapshot.volume;
        let found = exports.iter().find(|e| e.snapshot.is_none() && (&e.name == of || e.group.as_ref() == Some(of)));
        let Some(e) = found else {
            tracing::error!(
                snapshot = %s.snapshot.export_name(),
                "the volume of a pending snapshot operation is not served; left pending"
            );
            return;
        };
        let storage = e.volume as u32;
        let op = match s.delete {
            true => Op::SnapshotDelete { id: s.snapshot.id },
            false => Op::Snapshot { id: s.snapshot.id },
        };
        s.sent = true;
        s.asked = Instant::now();
        let (handle, recorded) = (self.handle.clone(), self.recorded.clone());
        tokio::spawn(async move {
            let result = record(&handle, storage, op).await;
            let _ = recorded.send((id, result));
        });
    }

    /// A snapshot's record is held by a write quorum (from sequence `taken_at` on): a taken
    /// snapshot is exported; both complete, and are answered.
    async fn on_recorded(&mut self, id: u64, result: Result<u64, String>) {
        let taken_at = match result {
            Ok(taken_at) => taken_at,
            Err(reason) => {
                tracing::warn!(
                    id,
                    "a snapshot's record was not sent: {reason}; the next host element to start sends it"
                );
                return;
            }
        };
        let Some(s) = self.snapshotting.remove(&id) else { return };
        let step = if s.delete { "snapshot-delete" } else { "snapshot-create" };
        failpoint_or_pause(&format!("{step}:after-record")).await;
        let snapshot = CatalogSnapshot { taken_at, ..s.snapshot };
        if !s.delete {
            self.export_snapshot(&snapshot).await;
        }
        failpoint(&format!("{step}:before-completion"));
        let now = self.now();
        if !s.delete {
            self.log.set_taken_at(id, taken_at);
        }
        self.log.finish(now, id, true);
        tracing::info!(snapshot = %snapshot.export_name(), id, taken_at, "snapshot {}", if s.delete { "deleted" } else { "taken" });
        if let Some(reply) = s.reply {
            let mut doc = describe_snapshot(id, &snapshot, s.delete, self.log.policy(), true);
            if !s.delete {
                // Its exports: `VOLUME@NAME`, or each member's of a consistency group.
                let exports = self.handle.exports();
                let names: Vec<&str> = exports
                    .iter()
                    .filter(|e| e.snapshot.is_some_and(|r| r.id == id))
                    .map(|e| e.name.as_str())
                    .collect();
                doc["exports"] = json!(names);
            }
            let _ = reply.send(Ok(doc));
        }
    }

    /// Export a taken snapshot read-only as `VOLUME@NAME`.
    async fn export_snapshot(&self, snapshot: &CatalogSnapshot) {
        let name = snapshot.export_name();
        let reference = proto::SnapshotRef { id: snapshot.id, taken_at: proto::Sequence(snapshot.taken_at) };
        let exported = self
            .handle
            .add_snapshot_export(name.clone(), snapshot.volume.clone(), reference, snapshot.size_bytes)
            .await;
        if let Err(reason) = exported {
            tracing::warn!(snapshot = %name, "snapshot not exported: {reason}");
        }
    }

    /// Every snapshot: exported, being taken, being deleted.
    fn list_snapshots(&self) -> Value {
        let mut snapshots: Vec<Value> = self
            .handle
            .exports()
            .iter()
            .filter_map(|e| {
                let reference = e.snapshot?;
                let (volume, name) = e.name.rsplit_once('@')?;
                Some(json!({
                    "name": e.name,
                    "volume": volume,
                    "snapshot": name,
                    "id": reference.id,
                    "size_bytes": e.size_bytes,
                    "taken_at": reference.taken_at.0,
                    "group": e.group,
                    "clones": self.log.clones_of(reference.id),
                    "state": "ready",
                }))
            })
            .collect();
        for (id, s) in &self.snapshotting {
            snapshots.push(json!({
                "name": s.snapshot.export_name(),
                "volume": s.snapshot.volume,
                "snapshot": s.snapshot.name,
                "id": id,
                "size_bytes": s.snapshot.size_bytes,
                "taken_at": null,
                "state": if s.delete { "deleting" } else { "taking" },
            }));
        }
        json!({ "snapshots": snapshots, "intention_log": self.log.policy().as_str(), "catalog_error": self.broken })
    }

    fn describe_created(&self, id: u64, k: &Creating, on_quorum: bool) -> Value {
        json!({
            "name": k.name,
            "size_bytes": k.size_bytes,
            "clone_of": k.clone_of,
            "group": k.group,
            "storage_volume": match &k.group {
                Some(_) => self.created.get(&k.name).cloned(),
                None => Some(catalog::storage_name(&k.name, id)),
            },
            "intention": id,
            "intention_log": self.log.policy().as_str(),
            "on_write_quorum": on_quorum,
        })
    }

    /// Every volume served: configured, and created while running (with creations under way).
    fn list(&self) -> Value {
        let served = self.log.catalog().volumes_served();
        let mut volumes: Vec<Value> = self
            .handle
            .exports()
            .iter()
            .map(|e| {
                let made = self.created.get(&e.name);
                let creating = self.creating.values().any(|k| k.name == e.name);
                let resizing = self.resizing.values().find(|r| r.name == e.name);
                let state = match resizing {
                    _ if creating => "creating",
                    Some(r) if r.volume.is_none() => "logging resize",
                    Some(r) if r.shrink => "shrinking (zeroing what lies past the new end)",
                    Some(_) => "resizing",
                    None => "ready",
                };
                let listed = made.and_then(|_| served.iter().find(|v| v.name == e.name));
                let storage_bytes = listed.map(|v| v.storage_bytes);
                let clone_of = listed.and_then(|v| v.clone_of.as_ref()).map(|s| s.export_name());
                json!({
                    "name": e.name,
                    "size_bytes": e.size_bytes,
                    "storage_bytes": storage_bytes,
                    "group": e.group,
                    "origin": if made.is_some() { "created" } else { "configured" },
                    "clone_of": clone_of,
                    "storage_volume": made,
                    "state": state,
                    "resizing_to": resizing.map(|r| r.size_bytes),
                })
            })
            .collect();
        for d in self.deleting.values() {
            let group = self.log.catalog().intentions.iter().find(|i| i.is_delete() && i.volume().name == d.name);
            let group = group.and_then(|i| i.volume().member_of).map(|w| w.group);
            volumes.push(json!({
                "name": d.name,
                "size_bytes": null,
                "group": group,
                "origin": "created",
                "storage_volume": d.storage,
                "state": if d.volume.is_none() { "logging deletion" } else if d.window.is_some() { "deleting (zeroing its window of its group)" } else if d.removed_live { "deleting (waiting for elements that are down)" } else { "deleting" },
            }));
        }
        for k in self.creating.values().filter(|k| k.volume.is_none()) {
            volumes.push(json!({
                "name": k.name,
                "size_bytes": k.size_bytes,
                "group": null,
                "origin": "created",
                "storage_volume": null,
                "state": "logging intention",
            }));
        }
        json!({
            "volumes": volumes,
            "intention_log": self.log.policy().as_str(),
            "catalog_error": self.broken,
        })
    }
}

fn describe_resized(id: u64, name: &str, storage: &str, size_bytes: u64, policy: LogPolicy, on_quorum: bool) -> Value {
    json!({
        "name": name,
        "size_bytes": size_bytes,
        "storage_volume": storage,
        "intention": id,
        "intention_log": policy.as_str(),
        "on_write_quorum": on_quorum,
    })
}

fn describe_snapshot(id: u64, snapshot: &CatalogSnapshot, delete: bool, policy: LogPolicy, on_quorum: bool) -> Value {
    json!({
        "name": snapshot.export_name(),
        "volume": snapshot.volume,
        "snapshot": snapshot.name,
        "id": snapshot.id,
        "size_bytes": snapshot.size_bytes,
        "taken_at": if delete || !on_quorum { None } else { Some(snapshot.taken_at) },
        "deleted": delete,
        "intention": id,
        "intention_log": policy.as_str(),
        "on_write_quorum": on_quorum,
    })
}

/// The failpoints' names of an intention's steps: `volume-create`, …, `snapshot-create`,
/// `snapshot-delete`.
fn step_prefix(intention: &Intention) -> String {
    match intention.op {
        Intent::SnapshotCreate { .. } => "snapshot-create".into(),
        Intent::SnapshotDelete { .. } => "snapshot-delete".into(),
        _ => format!("volume-{}", intention.kind()),
    }
}

/// Send `op` (a snapshot's record) to storage volume `volume` until a write quorum holds it,
/// then FLUSH it (durable on Q elements, whatever their ack policies): the volume's acknowledged
/// sequence then, at or after the record's. A write that fails (the volume lost its write
/// quorum) is tried again: an element that took the record already takes nothing from it
/// again. `Err` only if the host element stops or the catalog task's pass ended.
async fn record(handle: &HostHandle, volume: u32, op: Op) -> Result<u64, String> {
    let mut said = false;
    let mut written = false;
    loop {
        let request = if written { Request::Flush } else { Request::Write(op.clone()) };
        match handle.storage_request(volume, request).await {
            Some(Reply::Done(Ok(()))) if written => break,
            Some(Reply::Done(Ok(()))) => written = true,
            Some(Reply::Done(Err(e))) => {
                if !said {
                    tracing::warn!("a snapshot's record cannot be sent yet ({}); retrying", describe(e));
                    said = true;
                }
                tokio::time::sleep(ZERO_RETRY_WAIT).await;
            }
            _ => return Err("host element stopping".into()),
        }
    }
    let status = handle.status().await.ok_or("host element stopping")?;
    Ok(status.volumes.get(volume as usize).map_or(0, |v| v.acked_sequence.0))
}

fn describe_deleted(id: u64, name: &str, storage: &str, policy: LogPolicy, live: bool, everywhere: bool) -> Value {
    json!({
        "name": name,
        "storage_volume": storage,
        "intention": id,
        "intention_log": policy.as_str(),
        "removed_from_live_elements": live,
        "removed_everywhere": everywhere,
    })
}

/// Zero storage volume `volume` from `from_bytes` to `to_bytes`, then FLUSH (see
/// `Catalogue::zero_tail`). `Err` only if the host element stops or the catalog task's pass
/// ended (its requests are dropped).
async fn zero(handle: &HostHandle, volume: u32, from_bytes: u64, to_bytes: u64) -> Result<(), String> {
    let mut at = from_bytes;
    let mut said = false;
    loop {
        let request = if at < to_bytes {
            let length_bytes = (to_bytes - at).min(ZERO_CHUNK_BYTES);
            Request::Write(Op::WriteZeroes { offset_bytes: at, length_bytes })
        } else {
            Request::Flush
        };
        let flush = matches!(request, Request::Flush);
        match handle.storage_request(volume, request).await {
            Some(Reply::Done(Ok(()))) if flush => return Ok(()),
            Some(Reply::Done(Ok(()))) => at = (at + ZERO_CHUNK_BYTES).min(to_bytes),
            Some(Reply::Done(Err(e))) => {
                if !said {
                    tracing::warn!("a shrink cannot zero what lies past the new end yet ({}); retrying", describe(e));
                    said = true;
                }
                tokio::time::sleep(ZERO_RETRY_WAIT).await;
            }
            _ => return Err("host element stopping".into()),
        }
    }
}

fn describe(e: HostError) -> String {
    match e {
        HostError::ReadOnly => "read-only: fewer in-sync elements than the write quorum".into(),
        HostError::QuorumLost => "the write quorum was lost while writing".into(),
        HostError::Unavailable => "the host element is not serving".into(),
    }
}

/// What `STARFISH_FAILPOINT` asks at a step it names.
#[derive(Debug, PartialEq, Eq)]
enum Failpoint {
    /// `STEP` (or `STEP=` anything but a pause, so a mistyped pause is not silently ignored).
    Abort,
    /// `STEP=sleep(MS)`.
    Pause(Duration),
}

/// Abort the process here if `STARFISH_FAILPOINT` names this step (crash tests). A pause asked
/// at a step that cannot pause is ignored.
fn failpoint(step: &str) {
    if failpoint_at(step) == Some(Failpoint::Abort) {
        abort_at(step);
    }
}

/// As [`failpoint`], and `STARFISH_FAILPOINT=STEP=sleep(MS)` holds the operation at this step
/// for MS milliseconds (tests of what clients see while an operation is under way).
async fn failpoint_or_pause(step: &str) {
    match failpoint_at(step) {
        None => {}
        Some(Failpoint::Abort) => abort_at(step),
        Some(Failpoint::Pause(pause)) => {
            tracing::warn!(step, pause_ms = pause.as_millis() as u64, "failpoint: pausing");
            tokio::time::sleep(pause).await;
        }
    }
}

fn abort_at(step: &str) -> ! {
    tracing::error!("failpoint {step}: aborting");
    std::process::abort();
}

/// What `STARFISH_FAILPOINT` asks at `step`, if it names it.
fn failpoint_at(step: &str) -> Option<Failpoint> {
    let value = std::env::var("STARFISH_FAILPOINT").ok()?;
    let (named, action) = value.split_once('=').unwrap_or((value.as_str(), ""));
    if named != step {
        return None;
    }
    let pause = action.strip_prefix("sleep(").and_then(|a| a.strip_suffix(')')).and_then(|ms| ms.parse().ok());
    Some(pause.map_or(Failpoint::Abort, |ms| Failpoint::Pause(Duration::from_millis(ms))))
}
