//! StarFish's deterministic simulator (issue 6): the whole cluster — the real host element
//! core ([`starfish_core::HostCore`]) and in-memory elements — in one thread on a simulated
//! network, disk and clock, driven by one seed. Faults are drawn from the seed; checkers fail
//! the run on a contract breach. Same seed, same run: a failing seed prints the command that
//! replays it. See `docs/testing.md`.

pub mod element;
pub mod history;
pub mod model;
pub mod options;
pub mod report;
pub mod rng;
pub mod sector;
mod world;

pub use options::{Broken, FaultKind, SimOptions};
pub use report::{RunReport, Summary};

/// Run one seed. A panic inside (a core assertion, or the simulator's own) is a failed run,
/// not a crash of the caller.
pub fn run(options: &SimOptions) -> RunReport {
    let o = options.clone();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || world::World::new(o).run())) {
        Ok(report) => report,
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            RunReport {
                seed: options.seed,
                replay: options.replay_command(),
                violations: vec![format!("panic: {message}")],
                ..RunReport::default()
            }
        }
    }
}

/// Run seeds `first..first + count` on `threads` threads; reports in seed order.
pub fn run_many(base: &SimOptions, first: u64, count: u64, threads: usize) -> Vec<RunReport> {
    let threads = threads.clamp(1, 64);
    let next = std::sync::atomic::AtomicU64::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= count {
                    break;
                }
                let mut o = base.clone();
                o.seed = first + i;
                let report = run(&o);
                results.lock().expect("no panics while holding the lock").push(report);
            });
        }
    });
    let mut reports = results.into_inner().expect("threads joined");
    reports.sort_by_key(|r| r.seed);
    reports
}
