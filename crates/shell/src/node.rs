//! One host element process and its role: **active** (the core serving NBD, see `host.rs`) or
//! **standby** (serving nothing, watching the elements). A standby takes over when told
//! (`starfish failover`, `POST /failover`) or, with `--etcd`, by itself: once it holds the
//! cluster's `active` key and the elements say the host element they follow is gone.
//!
//! Taking over: ask the active host element to drain (if one answers at the admin address the
//! elements report), take an epoch above every one the elements follow (and above etcd's), bind
//! the NBD address (the drained one lets it go), and start the core with that epoch. The core
//! does the rest as at any start: the elements welcome the new epoch once the read lease they
//! promised the old one has run out (at once after a drain), it waits for `start_minimum` of
//! them — a set that meets every write quorum of the old one, so the old one can acknowledge
//! nothing more and every write it may have acknowledged is among the welcomes — and it rolls
//! them all forward to the newest history.
//!
//! A superseded active host element (the elements took a newer epoch) stops serving and becomes
//! a standby.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use proto::{ElementMessage, Epoch, HostId, HostMessage};
use serde_json::{json, Value};
use starfish_core::standby::{Decision, Key, Observation, StandbyConfig, StandbyCore};
use starfish_core::Time;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::coordination::{Coordinator, Holder};
use crate::host::{start_active, Active, HostOptions};

/// A standby asks each element this often whom it follows.
const OBSERVE_INTERVAL: Duration = Duration::from_millis(100);
/// A takeover's answer waits this long for every volume to serve.
const READY_WAIT: Duration = Duration::from_secs(10);
/// A drain answers what the clients sent within this, or the connections are cut.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// A drain or a stop gives the etcd key up within this, or leaves it to lapse.
const RESIGN_WAIT: Duration = Duration::from_secs(1);
/// A stopping host element answers what the clients sent within this, or the connections are
/// cut; then it waits this long at most for its in-sync elements to apply what it sent them.
const STOP_WAIT: Duration = Duration::from_secs(2);

/// The standby's view: the sans-IO decision core, the holders' admin addresses as the
/// elements report them, and the clock the core's `Time` counts from.
struct Watch {
    core: StandbyCore,
    admins: Vec<Option<String>>,
    origin: Instant,
}

impl Watch {
    fn now(&self) -> Time {
        Time(self.origin.elapsed().as_micros() as u64)
    }
}

pub struct Node {
    options: HostOptions,
    /// Our identity (also in etcd's `active` key): the core's `host_id`.
    host_id: HostId,
    admin_text: String,
    /// Transitions (take over, drain, step down) one at a time.
    active: tokio::sync::Mutex<Option<Active>>,
    /// For status without waiting on a transition.
    role: Mutex<RoleInfo>,
    watch: Mutex<Watch>,
    coordinator: tokio::sync::Mutex<Option<Coordinator>>,
    superseded_tx: mpsc::UnboundedSender<Epoch>,
    /// The live status page's feed (`GET /events`).
    feed: crate::status_page::Feed,
}

#[derive(Clone, Debug)]
struct RoleInfo {
    active: bool,
    epoch: Option<Epoch>,
    since: Instant,
    last_takeover: Option<Value>,
    /// The newer epoch the elements followed when this host element was superseded: its status
    /// shows it at once, before the observers' next answers do.
    superseded_by: Option<Epoch>,
}

/// Start a host element process: the admin endpoint, the element observers, and the active
/// host element at once unless it is a standby (`--standby`) or elected (`--etcd`).
pub async fn start(options: HostOptions) -> std::io::Result<Arc<Node>> {
    let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
    options.config.validate().map_err(invalid)?;
    let tls = options.tls.is_some();
    crate::tls::check_listen("NBD", options.nbd, tls, options.insecure).map_err(invalid)?;
    crate::tls::check_listen("the admin address", options.admin, tls, options.insecure).map_err(invalid)?;
    if options.nbd_tls_verify_peer && !tls {
        return Err(invalid("--nbd-tls-verify-peer needs --tls-dir".into()));
    }
    let admin_listener = TcpListener::bind(options.admin)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen for admin on {}: {e}", options.admin)))?;
    let (superseded_tx, mut superseded_rx) = mpsc::unbounded_channel();
    let n = options.element_addresses.len();
    let node = Arc::new(Node {
        host_id: options.config.host_id,
        admin_text: options.admin.to_string(),
        active: tokio::sync::Mutex::new(None),
        role: Mutex::new(RoleInfo {
            active: false,
            epoch: None,
            since: Instant::now(),
            last_takeover: None,
            superseded_by: None,
        }),
        watch: Mutex::new(Watch {
            core: StandbyCore::new(StandbyConfig::new(
                options.config.host_id,
                n,
                options.config.quorum,
                options.failover.takeover_after_ms,
            )),
            admins: vec![None; n],
            origin: Instant::now(),
        }),
        coordinator: tokio::sync::Mutex::new(None),
        superseded_tx,
        feed: Default::default(),
        options,
    });
    for (i, address) in node.options.element_addresses.iter().enumerate() {
        tokio::spawn(observe(Arc::downgrade(&node), i, *address));
    }
    {
        let node = node.clone();
        tokio::spawn(async move {
            while let Some(seen) = superseded_rx.recv().await {
                node.step_down("the elements follow a newer host element", seen).await;
            }
        });
    }
    let automatic = node.options.failover.etcd.is_some();
    if !node.options.failover.standby && !automatic {
        let address = node.options.nbd;
        let listener = TcpListener::bind(address)
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen for NBD on {address}: {e}")))?;
        let mut slot = node.active.lock().await;
        node.activate(&mut slot, node.options.config.epoch, Some(listener));
    } else {
        tracing::info!(
            admin = %node.options.admin,
            etcd = node.options.failover.etcd.as_deref().unwrap_or("none"),
            "host element is a standby: serving nothing until it takes over"
        );
    }
    if automatic {
        tokio::spawn(campaign(node.clone()));
    }
    tokio::spawn(sample_for_the_page(Arc::downgrade(&node)));
    tokio::spawn(crate::admin::serve(admin_listener, node.clone(), node.options.tls.clone()));
    tracing::info!(nbd = %node.options.nbd, admin = %node.options.admin, "host element listening");
    Ok(node)
}

impl Node {
    fn activate(&self, slot: &mut Option<Active>, epoch: Epoch, listener: Option<TcpListener>) {
        let mut config = self.options.config.clone();
        config.epoch = epoch;
        config.host_id = self.host_id;
        config.admin = self.admin_text.clone();
        let active = start_active(&self.options, config, listener, self.superseded_tx.clone());
        let mut role = self.role.lock().expect("role lock");
        role.active = true;
        role.epoch = Some(epoch);
        role.since = Instant::now();
        role.superseded_by = None;
        *slot = Some(active);
    }

    fn set_standby(&self) {
        let mut role = self.role.lock().expect("role lock");
        role.active = false;
        role.since = Instant::now();
    }

    /// The newest epoch any element follows, and its holder with the admin address the
    /// elements report for it.
    fn followed(&self) -> (Epoch, Option<(HostId, String)>) {
        let watch = self.watch.lock().expect("watch lock");
        let now = watch.now();
        let newest = watch.core.newest_epoch(now);
        let holder = watch.core.followed_holder(now).map(|holder| {
            let observations = watch.core.observations(now);
            let admin = observations
                .iter()
                .zip(&watch.admins)
                .find_map(|(o, a)| o.filter(|o| o.holder == holder).and(a.clone()))
                .unwrap_or_default();
            (holder, admin)
        });
        (newest, holder)
    }

    /// Take over now. `graceful`: first ask the active host element (if one answers) to drain.
    pub async fn take_over(self: &Arc<Self>, why: &str, graceful: bool) -> Result<Value, String> {
        let started = Instant::now();
        if self.active.lock().await.is_some() {
            return Err("this host element is already active".into());
        }
        // The drain may take seconds: not under the lock, so status requests go on meanwhile.
        let mut drained = Value::Null;
        if graceful {
            if let Some((holder, admin)) = self.followed().1 {
                if holder != self.host_id && !admin.is_empty() {
                    drained = match admin.parse::<SocketAddr>() {
                        Ok(address) => match tokio::time::timeout(
                            DRAIN_TIMEOUT,
                            post(address, "/drain", self.options.tls.as_ref()),
                        )
                        .await
                        {
                            Ok(Ok(_)) => json!({ "from": admin, "ok": true }),
                            Ok(Err(e)) => json!({ "from": admin, "ok": false, "error": e.to_string() }),
                            Err(_) => json!({ "from": admin, "ok": false, "error": "no answer" }),
                        },
                        Err(_) => json!({ "from": admin, "ok": false, "error": "not an address" }),
                    };
                    tracing::info!(%drained, "asked the active host element to drain");
                }
            }
        }
        let mut slot = self.active.lock().await;
        if slot.is_some() {
            return Err("this host element became active meanwhile".into());
        }
        let floor = self.followed().0 .0 + 1;
        let epoch = match self.coordinator.lock().await.as_mut() {
            Some(coordinator) => {
                if graceful {
                    // Told to: take the key whoever holds it (the old holder drained, or is
                    // fenced by the new epoch anyway).
                    let me = Holder { host_id: self.host_id.0, admin: self.admin_text.clone() };
                    let expected = coordinator.active().await?.map(|k| k.mod_revision);
                    if !coordinator.claim(&me, expected).await? {
                        return Err("etcd: another host element claimed the active key meanwhile".into());
                    }
                }
                Epoch(coordinator.next_epoch(floor).await?)
            }
            None => Epoch(floor),
        };
        // A drained host element let the address go; a frozen or cut-off one may still hold
        // it: the new one fences it through the elements anyway and serves NBD once it is
        // free (`start_active` binds it then).
        tracing::warn!(%epoch, why, "taking over as the active host element");
        self.activate(&mut slot, epoch, None);
        let handle = slot.as_ref().expect("just activated").handle.clone();
        drop(slot);
        let takeover_ms = started.elapsed().as_millis() as u64;
        // Until every volume serves again (bounded: the answer says if it did not).
        let deadline = Instant::now() + READY_WAIT;
        let mut ready_ms = None;
        while Instant::now() < deadline {
            let Some(status) = handle.status().await else { break };
            if !status.volumes.is_empty()
                && status.volumes.iter().all(|v| v.mode == starfish_core::VolumeMode::ReadWrite)
            {
                ready_ms = Some(started.elapsed().as_millis() as u64);
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let report = json!({
            "role": "active",
            "epoch": epoch.0,
            "why": why,
            "drained": drained,
            "takeover_ms": takeover_ms,
            "ready_ms": ready_ms,
        });
        self.role.lock().expect("role lock").last_takeover = Some(report.clone());
        Ok(report)
    }

    /// Start a scrub of `volume` (`POST /scrub`) at most `rate_bytes_per_s` (0: unlimited;
    /// `None`: the configured scrub rate); its progress is in the status document.
    pub async fn scrub(&self, volume: &str, rate_bytes_per_s: Option<u64>) -> Result<Value, String> {
        let rate_bytes_per_s = rate_bytes_per_s.unwrap_or(self.options.config.scrub_rate_bytes_per_s);
        let handle = self.active.lock().await.as_ref().map(|a| a.handle.clone());
        let Some(handle) = handle else {
            return Err("this host element is a standby: scrub through the active one".into());
        };
        let id = handle.scrub(volume, rate_bytes_per_s).await?;
        tracing::info!(volume, id, rate_bytes_per_s, "scrub started");
        Ok(json!({ "volume": volume, "id": id, "rate_bytes_per_s": rate_bytes_per_s }))
    }

    /// Create a volume (`starfish volume create`), through the catalog's intention log.
    /// Create a volume (`starfish volume create NAME SIZE [--group GROUP]`), joining
    /// consistency group `group` if given.
    pub async fn volume_create(&self, name: &str, size_bytes: u64, group: Option<String>) -> Result<Value, String> {
        let handle = self.active.lock().await.as_ref().map(|a| a.handle.clone());
        let Some(handle) = handle else {
            return Err("this host element is a standby: create volumes through the active one".into());
        };
        let name = name.to_string();
        let doc = handle
            .volume_order(|reply| crate::volumes::VolumeOrder::Create { name: name.clone(), size_bytes, group, reply })
            .await;
        match &doc {
            Ok(_) => tracing::info!(volume = %name, size_bytes, "volume created (starfish volume create)"),
            Err(e) => tracing::warn!(volume = %name, size_bytes, "volume create refused: {e}"),
        }
        doc
    }

    /// Create a volume as a clone of a snapshot (`starfish volume clone VOLUME@NAME NEW`).
    pub async fn volume_clone(&self, snapshot: &str, name: &str) -> Result<Value, String> {
        let handle = self.active.lock().await.as_ref().map(|a| a.handle.clone());
        let Some(handle) = handle else {
            return Err("this host element is a standby: create volumes through the active one".into());
        };
        let (snapshot, name) = (snapshot.to_string(), name.to_string());
        let doc = handle
            .volume_order(|reply| crate::volumes::VolumeOrder::Clone {
                snapshot: snapshot.clone(),
                name: name.clone(),
                reply,
            })
            .await;
        match &doc {
            Ok(_) => tracing::info!(volume = %name, %snapshot, "clone created (starfish volume clone)"),
            Err(e) => tracing::warn!(volume = %name, %snapshot, "volume clone refused: {e}"),
        }
        doc
    }

    /// Delete a volume created while running (`starfish volume delete`).
    pub async fn volume_delete(&self, name: &str, with_snapshots: bool) -> Result<Value, String> {
        let handle = self.active.lock().await.as_ref().map(|a| a.handle.clone());
        let Some(handle) = handle else {
            return Err("this host element is a standby: delete volumes through the active one".into());
        };
        let name = name.to_string();
        let doc = handle
            .volume_order(|reply| crate::volumes::VolumeOrder::Delete { name: name.clone(), with_snapshots, reply })
            .await;
        match &doc {
            Ok(_) => tracing::info!(volume = %name, "volume deleted (starfish volume delete)"),
            Err(reason) => tracing::warn!(volume = %name, "volume not deleted: {reason}"),
        }
        doc
    }

    /// Resize a volume created while running (`starfish volume resize [--shrink]`), through the
    /// catalog's intention log.
    pub async fn volume_resize(&self, name: &str, size_bytes: u64, shrink: bool) -> Result<Value, String> {
        let handle = self.active.lock().await.as_ref().map(|a| a.handle.clone());
        let Some(handle) = handle else {
            return Err("this host element is a standby: resize volumes through the active one".into());
        };
        let name = name.to_string();
        let doc = handle
            .volume_order(|reply| crate::volumes::VolumeOrder::Resize { name: name.clone(), size_bytes, shrink, reply })
            .await;
        match &doc {
            Ok(_) => tracing::info!(volume = %name, size_bytes, "volume resized (starfish volume resize)"),
            Err(reason) => tracing::warn!(volume = %name, size_bytes, "volume not resized: {reason}"),
        }
        doc
    }

    /// Every volume served (`starfish volume list`).
    pub async fn volume_list(&self) -> Result<Value, String> {
        let handle = self.active.lock().await.as_ref().map(|a| a.handle.clone());
        let Some(handle) = handle else {
            return Err("this host element is a standby: list volumes at the active one".into());
        };
        handle.volume_order(|reply| crate::volumes::VolumeOrder::List { reply }).await
    }

    /// `starfish snapshot create VOLUME NAME`, or `--group GROUP NAME` (`group`: `volume` names
    /// a consistency group) (see `crate::volumes`).
    pub async fn snapshot_create(&self, volume: &str, name: &str, group: bool) -> Result<Value, String> {
        self.snapshot_order(volume, name, Some(group)).await
    }

    /// `starfish snapshot delete VOLUME@NAME` (see `crate::volumes`).
    pub async fn snapshot_delete(&self, volume: &str, name: &str) -> Result<Value, String> {
        self.snapshot_order(volume, name, None).await
    }

    /// Hand a snapshot's creation (`create`: whether of a group) or deletion (`None`) to the
    /// catalog task, and log the outcome.
    async fn snapshot_order(&self, volume: &str, name: &str, create: Option<bool>) -> Result<Value, String> {
        let delete = create.is_none();
        let (what, done) = if delete { ("delete", "deleted") } else { ("take", "taken") };
        let handle = self.active.lock().await.as_ref().map(|a| a.handle.clone());
        let Some(handle) = handle else {
            return Err(format!("this host element is a standby: {what} snapshots through the active one"));
        };
        let (volume, name) = (volume.to_string(), name.to_string());
        let snapshot = format!("{volume}@{name}");
        let doc = handle
            .volume_order(|reply| match delete {
                true => crate::volumes::VolumeOrder::SnapshotDelete { volume, name, reply },
                false => {
                    crate::volumes::VolumeOrder::SnapshotCreate { volume, name, group: create == Some(true), reply }
                }
            })
            .await;
        match &doc {
            Ok(_) => tracing::info!(%snapshot, "snapshot {done}"),
            Err(reason) => tracing::warn!(%snapshot, "snapshot not {done}: {reason}"),
        }
        doc
    }

    /// `starfish snapshot list`.
    pub async fn snapshot_list(&self) -> Result<Value, String> {
        let handle = self.active.lock().await.as_ref().map(|a| a.handle.clone());
        let Some(handle) = handle else {
            return Err("this host element is a standby: list snapshots at the active one".into());
        };
        handle.volume_order(|reply| crate::volumes::VolumeOrder::SnapshotList { reply }).await
    }

    /// A graceful handover: stop taking requests, answer those taken, tell the elements we
    /// are gone (their read lease ends now), and become a standby.
    pub async fn drain(self: &Arc<Self>) -> Result<Value, String> {
        let started = Instant::now();
        let mut slot = self.active.lock().await;
        let Some(active) = slot.take() else {
            return Err("this host element is not active".into());
        };
        let _ = active.drain.send(true);
        let mut nbd = active.nbd;
        if tokio::time::timeout(DRAIN_TIMEOUT, &mut nbd).await.is_err() {
            tracing::warn!("drain: clients did not finish in time; connections cut");
            nbd.abort();
        }
        self.let_go(&active.handle, active.tasks, "drain").await;
        self.set_standby();
        tracing::warn!(epoch = %active.epoch, "drained and released: now a standby");
        Ok(json!({ "role": "standby", "drained_ms": started.elapsed().as_millis() as u64 }))
    }

    /// Tell the elements this host element is gone (their read lease ends now), stop its
    /// tasks, and give the etcd key up: a standby takes over without waiting for either to
    /// lapse. `what`: the drain or the stop, for the log.
    async fn let_go(&self, handle: &crate::host::HostHandle, tasks: Vec<tokio::task::JoinHandle<()>>, what: &str) {
        handle.release().await;
        // The frames are written by the sessions' tasks: give them a moment.
        tokio::time::sleep(Duration::from_millis(50)).await;
        for task in tasks {
            task.abort();
        }
        // Bounded: the campaign may hold the coordinator while etcd does not answer.
        let resign = async {
            match self.coordinator.lock().await.as_mut() {
                Some(coordinator) => coordinator.resign().await,
                None => Ok(()),
            }
        };
        let resigned =
            tokio::time::timeout(RESIGN_WAIT, resign).await.unwrap_or_else(|_| Err("etcd did not answer".into()));
        if let Err(e) = resigned {
            tracing::warn!(error = %e, "{what}: could not give the etcd key up (it lapses by itself)");
        }
    }

    /// A stop (SIGTERM): stop taking requests and answer those taken (at most `STOP_WAIT`,
    /// then the connections are cut: a client resends what was unanswered to the host element
    /// that serves next), then wait at most `STOP_WAIT` for every in-sync element to apply
    /// what it was sent. Nothing acknowledged depends on that wait (Q elements hold it), but
    /// without it the last element's copy trails until the next start catches it up, and an
    /// operator comparing copies after a clean stop would find them different. Then let the
    /// elements and the etcd key go, as a drain does, so a standby (or this host element
    /// started again) need not wait for the read lease and the key to lapse.
    pub async fn stop(&self) {
        let Some(active) = self.active.lock().await.take() else { return };
        let _ = active.drain.send(true);
        let mut nbd = active.nbd;
        if tokio::time::timeout(STOP_WAIT, &mut nbd).await.is_err() {
            tracing::warn!("stopping: clients' requests not answered in time; connections cut");
            nbd.abort();
        }
        match active.handle.wait_level(STOP_WAIT).await {
            Ok(()) => tracing::info!("stopping: every in-sync element holds every write"),
            Err(behind) => {
                tracing::warn!(%behind, "stopping with in-sync elements behind; they catch up at the next start")
            }
        }
        self.let_go(&active.handle, active.tasks, "stopping").await;
        tracing::info!(epoch = %active.epoch, "stopped and released");
    }

    async fn step_down(self: &Arc<Self>, why: &str, seen: Epoch) {
        let mut slot = self.active.lock().await;
        if let Some(active) = slot.take() {
            tracing::warn!(epoch = %active.epoch, %seen, why, "superseded: stopping, now a standby");
            active.abort();
            // Status waits for the `active` lock held here, so it never shows the standby
            // without the epoch it was superseded by.
            self.role.lock().expect("role lock").superseded_by = Some(seen);
            self.set_standby();
        }
    }

    /// The status document: the active core's (`admin::status_json`) or a standby's, with
    /// `role` either way.
    pub async fn status_json(&self) -> Option<Value> {
        self.status_and_totals(false).await.map(|(doc, _)| doc)
    }

    /// The live status page's feed.
    pub(crate) fn feed(&self) -> &crate::status_page::Feed {
        &self.feed
    }

    /// The status document, and (when active and asked for: the page's sampler) the totals
    /// the page's charts are drawn from.
    async fn status_and_totals(&self, with_totals: bool) -> Option<(Value, Option<crate::status_page::Totals>)> {
        let handle = self.active.lock().await.as_ref().map(|a| a.handle.clone());
        let role = self.role.lock().expect("role lock").clone();
        let (mut doc, totals) = match handle {
            Some(handle) => {
                let status = handle.status().await?;
                let totals = with_totals
                    .then(|| crate::status_page::Totals::new(Instant::now(), handle.chart_totals(), &status));
                let mut doc = crate::admin::status_json(
                    &status,
                    handle.addresses(),
                    &handle.links(),
                    &handle.exports(),
                    &handle.clients(),
                );
                doc["role"] = json!("active");
                (doc, totals)
            }
            None => (self.standby_json(role.superseded_by), None),
        };
        doc["host_id"] = json!(self.host_id.to_string());
        doc["admin"] = json!(self.admin_text);
        doc["role_since_ms"] = json!(role.since.elapsed().as_millis() as u64);
        doc["last_takeover"] = role.last_takeover.unwrap_or(Value::Null);
        doc["failover"] = json!({
            "standby": self.options.failover.standby,
            "etcd": self.options.failover.etcd,
            "takeover_after_ms": self.options.failover.takeover_after_ms,
        });
        Some((doc, totals))
    }

    pub async fn metrics(&self) -> Option<String> {
        let handle = self.active.lock().await.as_ref().map(|a| a.handle.clone());
        let active = self.role.lock().expect("role lock").active;
        match handle {
            Some(handle) => handle.metrics_text(active).await,
            None => Some(crate::metrics::HostMetrics::default().encode(active, None)),
        }
    }

    /// A standby's status; `superseded_by`: the epoch it learned of when it was superseded.
    fn standby_json(&self, superseded_by: Option<Epoch>) -> Value {
        let fresh = {
            let watch = self.watch.lock().expect("watch lock");
            watch.core.observations(watch.now())
        };
        let (epoch, holder) = self.followed();
        let epoch = superseded_by.map_or(epoch, |seen| epoch.max(seen));
        let elements: Vec<Value> = self
            .options
            .config
            .elements
            .iter()
            .zip(&self.options.element_addresses)
            .zip(&fresh)
            .map(|((name, address), o)| match o {
                Some(o) => json!({
                    "name": name,
                    "address": address.to_string(),
                    "reachable": true,
                    "epoch": o.epoch.0,
                    "holder": o.holder.to_string(),
                    "owner_absent_ms": o.owner_absent_ms,
                }),
                None => json!({ "name": name, "address": address.to_string(), "reachable": false }),
            })
            .collect();
        json!({
            "role": "standby",
            "epoch": epoch.0,
            "quorum": self.options.config.quorum,
            "active": holder.map(|(id, admin)| json!({ "host_id": id.to_string(), "admin": admin })),
            "volumes": [],
            "elements": elements,
        })
    }
}

/// Keep asking element `index` whom it follows (`Observe`), for as long as the node lives.
async fn observe(node: std::sync::Weak<Node>, index: usize, address: SocketAddr) {
    let mut nonce = 0u64;
    loop {
        let session = async {
            let tls = node.upgrade().and_then(|node| node.options.tls.clone());
            let expected = [crate::tls::Role::Element];
            let mut stream = crate::tls::connect(address, tls.as_ref(), &expected, Duration::from_secs(1)).await?;
            let mut buf = BytesMut::new();
            loop {
                nonce += 1;
                crate::element::send_frame(&mut stream, &HostMessage::Observe { nonce }).await?;
                let answer = tokio::time::timeout(
                    Duration::from_secs(1),
                    crate::element::recv_frame::<ElementMessage>(&mut stream, &mut buf),
                )
                .await
                .map_err(|_| "no answer".to_string())??;
                let (epoch, holder, holder_admin, owner_absent_ms) = match answer {
                    ElementMessage::Observed { epoch, holder, holder_admin, owner_absent_ms, .. } => {
                        (epoch, holder, holder_admin, owner_absent_ms)
                    }
                    ElementMessage::Refused { reason, .. } => return Err(format!("refused: {reason}")),
                    _ => return Err::<(), String>("unexpected answer to Observe".into()),
                };
                let Some(node) = node.upgrade() else { return Ok(()) };
                {
                    let mut watch = node.watch.lock().expect("watch lock");
                    let at = watch.now();
                    watch.core.observe(index, Some(Observation { epoch, holder, owner_absent_ms, at }));
                    watch.admins[index] = Some(holder_admin);
                }
                drop(node);
                tokio::time::sleep(OBSERVE_INTERVAL).await;
            }
        };
        let ended = session.await;
        let Some(node) = node.upgrade() else { return };
        node.watch.lock().expect("watch lock").core.observe(index, None);
        drop(node);
        if let Err(e) = ended {
            tracing::debug!(element = index, error = %e, "observer session ended");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// With etcd: keep our lease while active; while a standby, take over once elected and the
/// elements say the host element they follow is gone.
async fn campaign(node: Arc<Node>) {
    let failover = node.options.failover.clone();
    let endpoint = failover.etcd.clone().expect("campaign runs with etcd");
    let me = Holder { host_id: node.host_id.0, admin: node.admin_text.clone() };
    let mut last_keep_alive = Instant::now();
    let mut last_complaint: Option<Instant> = None;
    let mut complain = |what: String| {
        if last_complaint.is_none_or(|at| at.elapsed() > Duration::from_secs(5)) {
            tracing::warn!(error = %what, "etcd");
            last_complaint = Some(Instant::now());
        }
    };
    loop {
        tokio::time::sleep(OBSERVE_INTERVAL).await;
        let mut guard = node.coordinator.lock().await;
        if guard.is_none() {
            match Coordinator::connect(&endpoint, &failover.cluster).await {
                Ok(c) => *guard = Some(c),
                Err(e) => {
                    complain(e);
                    continue;
                }
            }
        }
        let coordinator = guard.as_mut().expect("connected");
        let active = node.role.lock().expect("role lock").active;
        if active {
            if last_keep_alive.elapsed() >= Duration::from_millis(600) {
                last_keep_alive = Instant::now();
                if let Err(e) = coordinator.keep_alive().await {
                    // Not deposed by this alone: only the elements decide (see the module
                    // comment of `coordination`).
                    complain(e);
                }
                // Our key lapsed (etcd was away longer than the lease) and nobody took it:
                // take it back, so that etcd names the host element that serves.
                if let Ok(None) = coordinator.active().await {
                    match coordinator.claim(&me, None).await {
                        Ok(true) => tracing::info!("etcd: the active key had lapsed; claimed it again"),
                        Ok(false) => {}
                        Err(e) => complain(e),
                    }
                }
            }
            continue;
        }
        // Read the key every time, so that a claim's age is known before it matters.
        let key = match coordinator.active().await {
            Err(e) => {
                complain(e);
                Key::Unknown
            }
            Ok(None) => Key::Absent,
            Ok(Some(k)) => Key::Held { holder: HostId(k.holder.host_id), revision: k.mod_revision },
        };
        let decision = {
            let mut watch = node.watch.lock().expect("watch lock");
            let now = watch.now();
            watch.core.decide(now, key)
        };
        let claimed = match decision {
            Decision::Wait => continue,
            Decision::TakeOver => Ok(true),
            Decision::Claim { expected } => coordinator.claim(&me, expected).await,
        };
        drop(guard);
        match claimed {
            Ok(true) => {
                if let Err(e) = node.take_over("elected: the elements lost the active host element", false).await {
                    tracing::warn!(error = %e, "takeover failed");
                }
                last_keep_alive = Instant::now();
            }
            Ok(false) => {}
            Err(e) => complain(e),
        }
    }
}

/// `POST path` to an admin endpoint (over HTTPS with this host element's certificate if TLS
/// is configured); the body of a 200 answer.
async fn post(admin: SocketAddr, path: &str, tls: Option<&crate::tls::TlsContext>) -> std::io::Result<String> {
    crate::admin::request(admin, "POST", path, tls).await
}

/// Once a second, the status page's sample of this host element (see `status_page.rs`).
async fn sample_for_the_page(node: std::sync::Weak<Node>) {
    let mut tick = tokio::time::interval(crate::status_page::SAMPLE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut before: Option<crate::status_page::Totals> = None;
    loop {
        tick.tick().await;
        let Some(node) = node.upgrade() else { return };
        let (doc, totals) = match node.status_and_totals(true).await {
            Some((doc, totals)) => (Some(doc), totals),
            None => (None, None),
        };
        let unix_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let sample = match (&before, &totals) {
            (Some(before), Some(after)) => Some(crate::status_page::sample(before, after, unix_ms)),
            _ => None,
        };
        before = totals;
        node.feed.publish(doc, sample);
    }
}
