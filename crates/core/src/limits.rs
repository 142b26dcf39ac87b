//! Every bound of the host element core, in one place, with their relations checked at compile
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
pub const HEARTBEAT_INTERVAL_MS_DEFAULT: u64 = 500;
pub const HEARTBEAT_TIMEOUT_MS_DEFAULT: u64 = 3_000;
/// At start, how long to wait for every element before proceeding with a quorum of them.
pub const STARTUP_GRACE_MS_DEFAULT: u64 = 3_000;

const _: () = assert!(ELEMENTS_MAX <= 64);
const _: () = assert!(WRITE_QUEUE_BYTES_DEFAULT >= WRITE_QUEUE_BYTES_MIN);
const _: () = assert!(HEARTBEAT_TIMEOUT_MS_DEFAULT > 2 * HEARTBEAT_INTERVAL_MS_DEFAULT);

/// Full recovery passes in a row (each followed by a replay the peers' logs no longer cover)
/// before the element is failed as unable to catch up.
pub const COPY_PASSES_MAX: u32 = 4;
