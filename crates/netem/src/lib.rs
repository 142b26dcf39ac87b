//! Link emulation for StarFish's tests, benchmarks and demo: a WAN path between two processes
//! with one-way delay, a rate limit, random and bursty (Gilbert) loss, and cut/heal at run time.
//! The kernel here has no `netem` qdisc, so the path is emulated in user space, two ways:
//!
//! - [`Link`] (root): two network namespaces (or one and the root namespace) joined by TUN
//!   devices and a packet relay in this process. The ends talk real kernel TCP, so loss,
//!   retransmission and congestion control behave as on a WAN.
//! - [`Proxy`] (unprivileged): a TCP proxy on 127.0.0.1 that delays and paces the byte stream,
//!   with cut/heal but no loss.
//!
//! The decisions (which packet is lost, when each one arrives) are made by the sans-IO
//! [`model::PathModel`]; the relay and the proxy only carry them out. [`measure`] compares
//! configured and observed delay and rate; [`cli`] is the `starfish link` subcommand. The
//! design and measured fidelity are in docs/link-emulation.md.
//!
//! Requirements of the namespace mode, and so of its tests: root (CAP_NET_ADMIN and
//! CAP_SYS_ADMIN), `ip` from iproute2, /dev/net/tun, and `sh` for the cleanup watchdog. Not
//! needed: the kernel's `netem` qdisc, `tc` and `nft`; rate and loss are applied by the relay.
//! Without them the namespace tests are reported as ignored, with the reason; the proxy mode
//! and its tests need nothing.

pub mod cli;
pub mod link;
pub mod measure;
pub mod model;
pub mod netns;
pub mod params;
pub mod proxy;
mod relay;
mod sys;

pub use link::{End, EndA, Link, LinkSpec, LinkStats, Side};
pub use model::PathStats;
pub use netns::remove_leftovers;
pub use params::{BurstLoss, LinkParams, ParamsError};
pub use proxy::Proxy;

/// Every bound of the crate, in one place.
pub mod limits {
    /// The longest one-way delay or queue accepted, ms.
    pub const DELAY_MS_MAX: f64 = 10_000.0;
    /// The lowest rate accepted, Mbit/s (one 1500-byte packet per 0.12 s).
    pub const RATE_MBIT_MIN: f64 = 0.1;
    /// The bottleneck queue when none is given, ms at the rate. Enough for a TCP flow to fill
    /// the rate on the paths we emulate (one bandwidth-delay product at 2 × 25 ms round trip),
    /// and the order of a WAN router's buffer.
    pub const QUEUE_MS_DEFAULT: f64 = 50.0;
    /// The TUN devices' MTU: an Ethernet path's.
    pub const MTU_BYTES: u32 = 1500;
    /// Buffer for one packet read from a TUN device (more than any MTU we set).
    pub const PACKET_BYTES_MAX: usize = 65_536;
    /// Packets the relay holds per direction; beyond, arrivals are dropped as by a full queue.
    /// At 10 Gbit/s and 30 ms one-way that is 25 000 full-size packets.
    pub const PACKETS_IN_FLIGHT_MAX: u64 = 65_536;
    /// How often sleeping threads look whether the link is being torn down, ms.
    pub const STOP_POLL_MS: u64 = 50;
    /// /30 subnets of 10.250.0.0/16 available to links.
    pub const LINK_SUBNETS: u32 = 16_384;
    /// The proxy reads a stream in chunks of at most this (and ~1 ms worth at the rate, at
    /// least `PROXY_CHUNK_BYTES_MIN`).
    pub const PROXY_CHUNK_BYTES_MAX: usize = 64 * 1024;
    pub const PROXY_CHUNK_BYTES_MIN: usize = 1024;
    /// How far the proxy reads ahead of its serialiser, ns.
    pub const PROXY_PACING_NS_MAX: u64 = 2_000_000;
    /// Bytes the proxy holds per direction of a connection (delay × rate must fit: 1 Gbit/s ×
    /// 60 ms is 7.5 MB).
    pub const PROXY_IN_FLIGHT_BYTES_MAX: usize = 16 * 1024 * 1024;
    /// The proxy's connect to its target.
    pub const CONNECT_TIMEOUT_MS: u64 = 5_000;

    const _: () = assert!(PROXY_CHUNK_BYTES_MIN <= PROXY_CHUNK_BYTES_MAX);
    const _: () = assert!(PROXY_CHUNK_BYTES_MAX <= PROXY_IN_FLIGHT_BYTES_MAX);
    const _: () = assert!(MTU_BYTES as usize <= PACKET_BYTES_MAX);
    const _: () = assert!(LINK_SUBNETS * 4 <= 65_536, "inside 10.250.0.0/16");
}

/// Why a link could not be set up or changed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error(transparent)]
    Params(#[from] ParamsError),
    #[error("the namespace mode needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); the proxy mode does not")]
    NotRoot,
    #[error("{0} is not installed")]
    ToolMissing(&'static str),
    #[error("/dev/net/tun is missing (load the tun module)")]
    NoTun,
    #[error("`{command}` failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("no free /30 in 10.250.0.0/16 for a link in the root namespace")]
    NoFreeSubnet,
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}
