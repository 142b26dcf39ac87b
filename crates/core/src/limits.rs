//! Every bound of the host element and element cores, in one place, with their relations checked at compile
//! time.

use proto::PAYLOAD_BYTES_MAX;

/// Elements per host element (an `ElementSet` is a u64 bitmask).
pub const ELEMENTS_MAX: usize = 16;
/// Volumes per host element.
pub const VOLUMES_MAX: usize = 256;
/// Bytes a write queue entry costs beyond its payload (bookkeeping), so that a queue full of
/// zero-payload trims is still bounded.
pub const WRITE_QUEUE_ENTRY_OVERHEAD_BYTES: u64 = 256;
/// Default write queue size per volume.
pub const WRITE_QUEUE_BYTES_DEFAULT: u64 = 128 * 1024 * 1024;
/// The write queue must hold at least one maximal write, or such a write could never be kept.
pub const WRITE_QUEUE_BYTES_MIN: u64 = PAYLOAD_BYTES_MAX as u64 + WRITE_QUEUE_ENTRY_OVERHEAD_BYTES;
/// Default read cache size (whole host element).
pub const READ_CACHE_BYTES_DEFAULT: u64 = 256 * 1024 * 1024;
/// Host writes waiting for room in a full write queue, per volume. Beyond this the shell's
/// per-connection in-flight bound is what stops reading from the host.
pub const ADMISSION_WAITING_MAX: usize = 4096;
/// How long a full write queue waits for a lagging element before declaring it failed.
pub const THROTTLE_TIMEOUT_MS_DEFAULT: u64 = 2_000;
/// Heartbeat period and the silence after which an element is declared failed.
pub const HEARTBEAT_INTERVAL_MS_DEFAULT: u64 = 100;
pub const HEARTBEAT_TIMEOUT_MS_DEFAULT: u64 = 3_000;
/// At start, how long to wait for every element before proceeding with a quorum of them.
pub const STARTUP_GRACE_MS_DEFAULT: u64 = 3_000;
/// Requests that arrive before the host element is ready are held this long, then fail (EIO).
pub const STARTUP_TIMEOUT_MS_DEFAULT: u64 = 10_000;
/// Background scrub of every volume: once a week (as Ceph's deep scrub), at most 32 MiB/s.
pub const SCRUB_INTERVAL_MS_DEFAULT: u64 = 7 * 24 * 3600 * 1000;
pub const SCRUB_RATE_BYTES_PER_S_DEFAULT: u64 = 32 * 1024 * 1024;

const _: () = assert!(ELEMENTS_MAX <= 64);
const _: () = assert!(WRITE_QUEUE_BYTES_DEFAULT >= WRITE_QUEUE_BYTES_MIN);
const _: () = assert!(HEARTBEAT_TIMEOUT_MS_DEFAULT > 2 * HEARTBEAT_INTERVAL_MS_DEFAULT);

/// Full recovery passes in a row (each followed by a replay the peers' logs no longer cover)
/// before the element is failed as unable to catch up.
pub const COPY_PASSES_MAX: u32 = 4;

// ----- the element core ------------------------------------------------------------------------

/// Records taken into one group commit at most, and their payload bytes.
pub const COMMIT_BATCH_RECORDS_MAX: usize = 1024;
pub const COMMIT_BATCH_BYTES_MAX: u64 = 64 * 1024 * 1024;
/// Payload bytes in one `LogRecords` reply at most (beyond a single larger record), so that the
/// frame stays within the frame bound with the per-record overhead of small records.
pub const LOG_REPLY_BYTES_MAX: u64 = PAYLOAD_BYTES_MAX as u64 / 2;
/// Payload bytes a replay asks of its peer per fetch: one fetch is in flight at a time, so each
/// costs an idle round trip; 16 MiB keeps a 124 Mbit/s link with a 130 ms round trip ~90 % busy.
pub const REPLAY_FETCH_BYTES: u64 = LOG_REPLY_BYTES_MAX;
/// Current writes a replaying element keeps in memory (all volumes together) while it pulls
/// its gap from a peer, so that a replay paced below the foreground write rate still finishes.
/// Beyond it the element drops them and pulls them from the peer too.
pub const REPLAY_STASH_BYTES_MAX: u64 = 256 * 1024 * 1024;
/// A replay's peer that has had nothing new for this long has failed it.
pub const REPLAY_IDLE_TIMEOUT_MS: u64 = 30_000;
/// How long a replay waits before asking again a peer that had nothing new yet.
pub const REPLAY_EMPTY_RETRY_MS: u64 = 10;
/// How long a copy source waits for its applied sequence to reach a request's `min_applied`.
pub const SOURCE_CATCH_UP_TIMEOUT_MS: u64 = 10_000;
/// Messages a session may send while its `Hello` is being answered.
pub const SESSION_DEFERRED_MAX: usize = 65_536;
/// Volumes one session may number (its hello's and those added while it runs); the wire
/// format's bound on a volume list.
pub const VOLUMES_PER_SESSION_MAX: usize = 4096;

const _: () = assert!(REPLAY_FETCH_BYTES <= LOG_REPLY_BYTES_MAX);
const _: () = assert!(REPLAY_STASH_BYTES_MAX >= 2 * PAYLOAD_BYTES_MAX as u64);
const _: () = assert!(COMMIT_BATCH_BYTES_MAX >= PAYLOAD_BYTES_MAX as u64);

/// Reads a host element has out at one element at most: what its replies delivered in this
/// long, as last measured, and at least `READ_WINDOW_BYTES_MIN` (one read of any size may
/// always be out). More wait at the host element: an element's pongs, which renew the read
/// lease, never queue behind more than about this much of its replies.
pub const READ_WINDOW_MS: u64 = 100;
pub const READ_WINDOW_BYTES_MIN: u64 = 1024 * 1024;
/// What a block-status reply counts for in that window.
pub const BLOCK_STATUS_REPLY_BYTES: u64 = 4096;

/// An element's read lease: after each pong it sends the host element it follows, it welcomes
/// no other host element's epoch for this long (see ARCHITECTURE.md, "Failover").
pub const LEASE_MS_DEFAULT: u64 = 500;
/// A host element counts a lease as this many thousandths of what the element promised: the
/// two clocks may run at different rates (by at most 10 %, assumed).
pub const LEASE_CLOCK_MARGIN_PERMILLE: u64 = 900;
/// An element says the host element it follows is absent when no session of its epoch is open,
/// or when none has sent anything for this long (a paused process keeps its sessions open).
pub const OWNER_SILENCE_MS_DEFAULT: u64 = 500;
/// What an element reports as `owner_absent_ms` once its host element released it (a graceful
/// handover): gone for good.
pub const OWNER_RELEASED_ABSENT_MS: u64 = 86_400_000;
const _: () = assert!(OWNER_SILENCE_MS_DEFAULT > 2 * HEARTBEAT_INTERVAL_MS_DEFAULT);
/// A standby takes over once the elements have missed the active host element this long
/// (`--takeover-after-ms`).
pub const TAKEOVER_AFTER_MS_DEFAULT: u64 = 300;
/// A standby counts an element's observation for this long.
pub const OBSERVATION_FRESH_MS: u64 = 1_000;
/// A standby leaves a freshly claimed `active` key to its holder for this long before it may
/// take it over (the holder needs the time to take the elements).
pub const CLAIM_GRACE_MS: u64 = 1_500;

/// The furthest a hello may move an element's epoch at once. Host elements take the newest
/// epoch they see plus one (one per start or takeover); a hello far beyond (2^64 − 1, say)
/// would leave no newer epoch for any host element and fence them all for good.
pub const EPOCH_JUMP_MAX: u64 = 1 << 32;
