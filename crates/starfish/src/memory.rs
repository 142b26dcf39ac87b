//! The process's allocator: jemalloc, whose background threads give freed memory back to the
//! kernel some seconds after it was freed, busy or idle.
//!
//! The data path allocates a buffer for every frame and NBD request it reads and frees it a
//! few hundred microseconds later, from another thread as often as not. With glibc's malloc
//! that took 12 % of the host element's samples at 4 KiB writes (`unlink_chunk`,
//! `malloc_consolidate`, …), and keeping its pages needed tuning (`mallopt`) and a trim when
//! the process went idle. Against that tuned glibc, jemalloc ran 4 KiB writes at QD16 19–25 %
//! faster with 23–25 % less host element CPU per write, 1 MiB writes 14–29 % faster, and left
//! the host element at half the resident memory after the same load (docs/benchmarks.md).
//! Its options can be set with `_RJEM_MALLOC_CONF` (the prefixed build's `MALLOC_CONF`), e.g.
//! `_RJEM_MALLOC_CONF=dirty_decay_ms:1000` to give memory back sooner.

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read before `main` (the environment's `_RJEM_MALLOC_CONF` comes after
/// them and wins): `oversize_threshold` at 32 MiB, the largest payload, instead of 8 MiB.
/// jemalloc purges an extent of that size or more the moment it is freed, and it coalesces
/// freed neighbours first: at the default the 1 MiB buffers the data path allocates and frees
/// at large writes merged into 8–10 MiB extents that went back to the kernel at once, so every
/// NBD payload and frame read into memory took a page fault and a page clearing per 4 KiB
/// (host element at 1 MiB writes QD16: 33–101 faults per write in our runs, and 13 % of its
/// samples; 5–13 with 32 MiB). Not higher (0 turns the threshold off): a maximal frame's buffer is still purged
/// when freed, so what strangers' stalled maximal frames leave held stays within the element's
/// bound on frames arriving (with 0, 311–373 MiB against 249 MiB under sixteen of them;
/// docs/benchmarks.md).
#[repr(transparent)]
pub struct MallocConf(*const std::ffi::c_char);

// SAFETY: the pointer is to a static C string, never written.
unsafe impl Sync for MallocConf {}

#[export_name = "_rjem_malloc_conf"]
pub static MALLOC_CONF: MallocConf = MallocConf(c"oversize_threshold:33554432".as_ptr());
