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
    run_until(base, first, count, threads, |_| false)
}

/// Run seeds `first..first + count` on `threads` threads, in seed order, and stop at the first
/// seed whose reports so far (`first` up to it) satisfy `enough`: what a broken variant's sweep
/// needs once it has caught enough runs. The result is the same whatever the threads' timing:
/// the reports of `first` up to that seed (all of them when `enough` never holds), in seed
/// order; a seed a thread ran past it is dropped.
pub fn run_until(
    base: &SimOptions,
    first: u64,
    count: u64,
    threads: usize,
    enough: impl Fn(&[RunReport]) -> bool + Sync,
) -> Vec<RunReport> {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    struct Done {
        /// Reports of the seeds `first..first + in_order.len()`, in order.
        in_order: Vec<RunReport>,
        /// Finished seeds waiting for an earlier one.
        waiting: std::collections::BTreeMap<u64, RunReport>,
        /// `in_order` satisfied `enough` when it reached this length.
        stopped_at: Option<usize>,
    }
    let threads = threads.clamp(1, 64);
    let next = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let done = std::sync::Mutex::new(Done { in_order: Vec::new(), waiting: Default::default(), stopped_at: None });
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                let mut o = base.clone();
                o.seed = first + i;
                let report = run(&o);
                let mut d = done.lock().expect("no panics while holding the lock");
                d.waiting.insert(i, report);
                // Move the seeds now in order over, judging `enough` after each one.
                loop {
                    let at = d.in_order.len() as u64;
                    let Some(report) = d.waiting.remove(&at) else { break };
                    d.in_order.push(report);
                    if d.stopped_at.is_none() && enough(&d.in_order) {
                        d.stopped_at = Some(d.in_order.len());
                        stop.store(true, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let mut d = done.into_inner().expect("threads joined");
    let keep = d.stopped_at.unwrap_or(d.in_order.len());
    d.in_order.truncate(keep);
    assert!(
        d.stopped_at.is_some() || d.in_order.len() as u64 == count,
        "every seed ran when `enough` never held ({} of {count})",
        d.in_order.len()
    );
    d.in_order
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `run_until` stops at the first seed whose prefix is enough, whatever the threads did
    /// meanwhile, and runs every seed when nothing is enough.
    #[test]
    fn run_until_returns_the_prefix_up_to_the_first_seed_that_is_enough() {
        let mut o = SimOptions::new(0, 1, 1);
        o.fault_phase_ms = 500;
        for threads in [1, 2, 3] {
            let reports = run_until(&o, 40, 9, threads, |rs| rs.iter().any(|r| r.seed == 43));
            let seeds: Vec<u64> = reports.iter().map(|r| r.seed).collect();
            assert_eq!(seeds, vec![40, 41, 42, 43], "{threads} threads");
            let all: Vec<u64> = run_until(&o, 40, 5, threads, |_| false).iter().map(|r| r.seed).collect();
            assert_eq!(all, vec![40, 41, 42, 43, 44], "{threads} threads");
        }
        let many = run_many(&o, 40, 5, 2);
        let one_by_one: Vec<RunReport> = (40..45).map(|seed| run(&SimOptions { seed, ..o.clone() })).collect();
        assert_eq!(format!("{many:?}"), format!("{one_by_one:?}"), "the same reports, in seed order");
    }
}
