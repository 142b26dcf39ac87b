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
