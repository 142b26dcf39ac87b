//! An emulated link between two network namespaces (or a namespace and the root namespace):
//! each end has a TUN device with one IPv4 address and a route to the other end's address, and
//! the relay (`relay.rs`) carries packets between the two devices through the path model.
//! Processes at the ends talk real kernel TCP (the kernel's congestion control included); only
//! the wire between them is emulated.
//!
//! ```text
//!   namespace A                        this process                      namespace B
//!   app ── TCP ── sfn-…a (10.250.x.1) ⇄ relay: loss, rate, delay ⇄ sfn-…b (10.250.x.2) ── TCP ── app
//! ```

use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use serde::Serialize;

use crate::limits::{LINK_SUBNETS, MTU_BYTES};
use crate::model::PathStats;
use crate::netns::{self, Namespace, Watchdog, NAME_PREFIX};
use crate::params::LinkParams;
use crate::relay::{self, lock, Relay, SharedModel};
use crate::{sys, LinkError};

/// One end of a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Side {
    A,
    B,
}

impl Side {
    fn index(self) -> usize {
        match self {
            Side::A => 0,
            Side::B => 1,
        }
    }

    fn letter(self) -> char {
        match self {
            Side::A => 'a',
            Side::B => 'b',
        }
    }
}

/// Where an end lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EndA {
    /// Both ends in namespaces of their own: nothing changes in the root namespace.
    #[default]
    Namespace,
    /// End A in the root namespace: any process on the machine reaches end B's address
    /// through the link, and a server there can bind end A's address.
    RootNamespace,
}

/// How to build a link.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LinkSpec {
    pub params: LinkParams,
    pub end_a: EndA,
    /// Seed of the loss models (each direction derives its own); the same seed gives the same
    /// loss decisions for the same packet sequence.
    pub seed: u64,
}

/// One end as a process sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct End {
    pub side: Side,
    /// The namespace to run a process in (`ip netns exec NAME …`); `None`: the root namespace.
    pub namespace: Option<String>,
    /// The end's address: bind servers to it, connect to the other end's.
    pub address: Ipv4Addr,
    /// The TUN device carrying the end's traffic.
    pub device: String,
}

/// Counters of both directions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LinkStats {
    pub a_to_b: PathStats,
    pub b_to_a: PathStats,
}

/// A live emulated link. Dropping it stops the relay, removes the TUN devices and deletes the
/// namespaces (processes still running inside keep their namespace until they exit, without
/// a network).
#[derive(Debug)]
pub struct Link {
    ends: [End; 2],
    models: [SharedModel; 2],
    relay: Option<Relay>,
    /// The TUN descriptors; closing them removes the devices.
    tuns: Vec<Arc<OwnedFd>>,
    namespaces: Vec<Namespace>,
    watchdog: Option<Watchdog>,
}

static LINKS_CREATED: AtomicU32 = AtomicU32::new(0);

impl Link {
    /// Creates the namespaces, the TUN devices, their addresses and routes, and starts the
    /// relay. Needs root, `ip` (iproute2) and /dev/net/tun.
    pub fn create(spec: LinkSpec) -> Result<Link, LinkError> {
        spec.params.validate()?;
        netns::check_prerequisites()?;
        for name in netns::remove_leftovers()? {
            tracing::info!(namespace = %name, "removed a namespace left by a dead process");
        }
        let pid = std::process::id();
        let number = LINKS_CREATED.fetch_add(1, Ordering::Relaxed);
        let namespace_names: Vec<String> = match spec.end_a {
            EndA::Namespace => vec![format!("{NAME_PREFIX}{pid}-{number}-a"), format!("{NAME_PREFIX}{pid}-{number}-b")],
            EndA::RootNamespace => vec![format!("{NAME_PREFIX}{pid}-{number}-b")],
        };
        // Started first, so that every later step is covered if this process dies.
        let watchdog = Watchdog::start(&namespace_names)?;
        let mut namespaces = Vec::new();
        for name in &namespace_names {
            namespaces.push(Namespace::create(name.clone())?);
        }
        let subnet = choose_subnet(spec.end_a, pid, number)?;
        let mut ends = Vec::new();
        let mut tuns = Vec::new();
        for side in [Side::A, Side::B] {
            let namespace = match (spec.end_a, side) {
                (EndA::RootNamespace, Side::A) => None,
                (EndA::Namespace, Side::A) => Some(&namespaces[0]),
                (_, Side::B) => namespaces.last(),
            };
            // Interface names have at most 15 bytes: sfn-<pid ≤ 7 digits>-<2 digits><side>.
            let device = format!("{NAME_PREFIX}{pid}-{:02}{}", number % 100, side.letter());
            let open = || sys::open_tun(&device);
            let tun = match namespace {
                Some(ns) => ns.run_in(open)?,
                None => open(),
            }
            .map_err(|e| LinkError::Io { what: format!("creating TUN device {device}"), source: e })?;
            tuns.push(Arc::new(tun));
            let (address, peer) = match side {
                Side::A => (subnet.0, subnet.1),
                Side::B => (subnet.1, subnet.0),
            };
            configure_device(namespace.map(Namespace::name), &device, address, peer)?;
            ends.push(End { side, namespace: namespace.map(|ns| ns.name().to_string()), address, device });
        }
        let models = relay::models(spec.params);
        let relay = Relay::start(tuns[0].clone(), tuns[1].clone(), models.clone(), spec.seed)
            .map_err(|e| LinkError::Io { what: "starting the relay".into(), source: e })?;
        let ends: [End; 2] = ends.try_into().expect("two ends");
        tracing::info!(a = %ends[0].address, b = %ends[1].address, params = %spec.params, "link up");
        Ok(Link { ends, models, relay: Some(relay), tuns, namespaces, watchdog: Some(watchdog) })
    }

    pub fn end(&self, side: Side) -> &End {
        &self.ends[side.index()]
    }

    /// Changes the parameters of both directions at once; packets already on the wire keep
    /// their delivery time.
    pub fn set(&self, params: LinkParams) -> Result<(), LinkError> {
        params.validate()?;
        for model in &self.models {
            lock(model).set_params(params);
        }
        Ok(())
    }

    pub fn params(&self) -> LinkParams {
        lock(&self.models[0]).params()
    }

    /// Cuts both directions: every packet is lost, including those on the wire, until
    /// [`Link::heal`]. TCP connections survive a cut shorter than their retransmission timeout.
    pub fn cut(&self) {
        for model in &self.models {
            lock(model).cut();
        }
    }

    /// Both directions refuse new packets and deliver those on the wire: a site that vanishes
    /// (its packets already sent still arrive). Undone by [`Link::heal`].
    pub fn close_entries(&self) {
        for model in &self.models {
            lock(model).close_entry();
        }
    }

    pub fn heal(&self) {
        for model in &self.models {
            lock(model).heal();
        }
    }

    pub fn is_cut(&self) -> bool {
        lock(&self.models[0]).is_cut()
    }

    pub fn stats(&self) -> LinkStats {
        LinkStats { a_to_b: lock(&self.models[0]).stats(), b_to_a: lock(&self.models[1]).stats() }
    }

    /// Runs `f` on a thread inside `side`'s namespace (or the root namespace) and returns its
    /// result: a listener bound or a stream connected there stays there.
    pub fn run_in<T: Send, F: FnOnce() -> T + Send>(&self, side: Side, f: F) -> Result<T, LinkError> {
        match self.namespace_of(side) {
            Some(ns) => ns.run_in(f),
            None => {
                Ok(std::thread::scope(|scope| scope.spawn(f).join().unwrap_or_else(|p| std::panic::resume_unwind(p))))
            }
        }
    }

    /// A command that runs `program` at `side`: `ip netns exec NAME program`, or `program`
    /// itself for an end in the root namespace. The caller owns (and must stop) the process.
    pub fn command(&self, side: Side, program: &str) -> Command {
        match &self.end(side).namespace {
            Some(ns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", ns, program]);
                command
            }
            None => Command::new(program),
        }
    }

    fn namespace_of(&self, side: Side) -> Option<&Namespace> {
        let name = self.end(side).namespace.as_deref()?;
        self.namespaces.iter().find(|ns| ns.name() == name)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Some(mut relay) = self.relay.take() {
            relay.stop();
        }
        self.tuns.clear();
        let mut all_deleted = true;
        for namespace in self.namespaces.drain(..) {
            let name = namespace.name().to_string();
            if let Err(e) = namespace.delete() {
                tracing::warn!(namespace = %name, error = %e, "could not delete network namespace");
                all_deleted = false;
            }
        }
        if let Some(watchdog) = self.watchdog.take() {
            if all_deleted {
                watchdog.release();
            }
            // Otherwise dropping it makes the watchdog try again at once.
        }
        tracing::info!(a = %self.ends[0].address, b = %self.ends[1].address, "link down");
    }
}

/// Gives the device its address, a host route to the peer's address, and brings it up.
fn configure_device(namespace: Option<&str>, device: &str, address: Ipv4Addr, peer: Ipv4Addr) -> Result<(), LinkError> {
    let ip_in = |args: &[&str]| -> Result<(), LinkError> {
        match namespace {
            Some(ns) => netns::ip(&[&["-n", ns], args].concat()),
            None => netns::ip(args),
        }
    };
    let mtu = MTU_BYTES.to_string();
    // No IPv6 link-local address: router solicitations would only add noise on the link.
    let _ = ip_in(&["link", "set", "dev", device, "addrgenmode", "none"]);
    ip_in(&["link", "set", "dev", device, "mtu", &mtu, "txqueuelen", "1000"])?;
    ip_in(&["addr", "add", &address.to_string(), "peer", &format!("{peer}/32"), "dev", device])?;
    ip_in(&["link", "set", "dev", device, "up"])
}

/// The two ends' addresses: a /30 of 10.250.0.0/16. With both ends in namespaces any /30
/// works; with end A in the root namespace it must not be in use there, so start at a place
/// derived from the pid and skip addresses that are taken.
fn choose_subnet(end_a: EndA, pid: u32, number: u32) -> Result<(Ipv4Addr, Ipv4Addr), LinkError> {
    let subnet_of = |index: u32| {
        let base = u32::from(Ipv4Addr::new(10, 250, 0, 0)) + 4 * (index % LINK_SUBNETS);
        (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
    };
    match end_a {
        EndA::Namespace => Ok(subnet_of(number)),
        EndA::RootNamespace => {
            let in_use = netns::ip_output(&["-o", "-4", "addr", "show"])?;
            let start = pid.wrapping_mul(2_654_435_761).wrapping_add(number);
            (0..LINK_SUBNETS)
                .map(|i| subnet_of(start.wrapping_add(i)))
                .find(|(a, b)| {
                    !in_use.contains(&format!("inet {a}/"))
                        && !in_use.contains(&format!("inet {a} "))
                        && !in_use.contains(&format!(" {b}/"))
                })
                .ok_or(LinkError::NoFreeSubnet)
        }
    }
}
