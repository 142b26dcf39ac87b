//! The process's memory: how glibc's malloc keeps freed memory while the data path runs, and
//! gives it back once the process goes idle.

use std::time::Duration;

/// Keep freed memory in the process instead of giving it back to the kernel at once.
///
/// The data path allocates a buffer for every frame it reads (a payload stays referenced until
/// its record is committed, so a read buffer is rarely reused in place) and frees it a few
/// hundred microseconds later. With glibc's defaults, buffers from 128 KiB up are mapped and
/// unmapped each time, and a heap top over 128 KiB is trimmed: every new buffer is then fresh
/// pages that the kernel zeroes on first touch — 10 to 20 % of the host element's and the
/// elements' CPU under load (docs/benchmarks.md). Allocations up to 32 MiB come from the heap,
/// and a heap gives memory back only once 32 MiB at its top are free (an element keeps some
/// 50–100 MiB more resident than with the defaults); [`trim_when_idle`] gives the rest back
/// after a burst. An operator's own `GLIBC_TUNABLES` malloc settings win.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn tune_malloc() {
    if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.")) {
        return;
    }
    const MMAP_THRESHOLD_BYTES: libc::c_int = 32 << 20;
    const TRIM_THRESHOLD_BYTES: libc::c_int = 32 << 20;
    const TOP_PAD_BYTES: libc::c_int = 4 << 20;
    // SAFETY: mallopt only changes the allocator's parameters; it is called before any thread
    // is started. A value it refuses leaves that parameter as it was (it returns 0).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES);
        libc::mallopt(libc::M_TOP_PAD, TOP_PAD_BYTES);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn tune_malloc() {}

/// How often the process looks whether it went idle.
const IDLE_CHECK_EVERY: Duration = Duration::from_secs(5);
/// Below this share of one core over a check's interval, the process counts as idle.
const IDLE_CPU_SHARE: f64 = 0.02;

/// When to give freed memory back: once per idle stretch that follows a busy one (a trim walks
/// every heap under its lock, so never while requests come).
#[derive(Debug, Default)]
struct IdleTrim {
    busy_since_trim: bool,
}

impl IdleTrim {
    /// The process used `cpu` over the last `elapsed`: whether to trim now.
    fn observe(&mut self, cpu: Duration, elapsed: Duration) -> bool {
        let idle = cpu.as_secs_f64() < IDLE_CPU_SHARE * elapsed.as_secs_f64();
        if !idle {
            self.busy_since_trim = true;
            return false;
        }
        std::mem::take(&mut self.busy_since_trim)
    }
}

/// Give the memory malloc freed and kept (fragments between live blocks included: glibc
/// otherwise returns only a heap's top) back to the kernel each time the process goes idle
/// after a burst: a host element holding 777 MiB after a burst held 454 MiB, its write queue and
/// read cache, after a trim (docs/benchmarks.md). Runs for the life of the runtime.
pub async fn trim_when_idle() {
    let mut trim = IdleTrim::default();
    let mut last = (std::time::Instant::now(), process_cpu());
    loop {
        tokio::time::sleep(IDLE_CHECK_EVERY).await;
        let now = (std::time::Instant::now(), process_cpu());
        let decided = trim.observe(now.1.saturating_sub(last.1), now.0 - last.0);
        last = now;
        if decided {
            let _ = tokio::task::spawn_blocking(give_back).await;
            last = (std::time::Instant::now(), process_cpu());
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn give_back() {
    // SAFETY: malloc_trim has no preconditions; it only returns free memory to the kernel.
    let released = unsafe { libc::malloc_trim(0) };
    tracing::debug!(released = released != 0, "idle: freed memory given back to the system");
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn give_back() {}

/// User and system CPU time the process used so far.
fn process_cpu() -> Duration {
    // SAFETY: getrusage fills a plain out-parameter of the right type.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return Duration::ZERO;
    }
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    time(usage.ru_utime) + time(usage.ru_stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_given_back_once_per_idle_stretch_after_a_busy_one() {
        let mut trim = IdleTrim::default();
        let interval = Duration::from_secs(5);
        let busy = Duration::from_secs(2);
        let idle = Duration::from_millis(20);
        // Idle from the start: nothing was freed by a burst yet.
        assert!(!trim.observe(idle, interval));
        assert!(!trim.observe(busy, interval));
        assert!(!trim.observe(busy, interval));
        // The first idle interval after the burst trims, the next ones do not.
        assert!(trim.observe(idle, interval));
        assert!(!trim.observe(idle, interval));
        assert!(!trim.observe(Duration::ZERO, interval));
        // Just above the idle share is busy.
        assert!(!trim.observe(Duration::from_millis(101), interval));
        assert!(trim.observe(Duration::from_millis(99), interval));
    }

    #[test]
    fn the_process_cpu_time_moves_forward() {
        let before = process_cpu();
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(process_cpu() > before);
    }
}
