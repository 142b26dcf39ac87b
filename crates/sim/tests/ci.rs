//! The simulator in CI: a few hundred seeded fault schedules must show no contract breach,
//! configurations the paper says can lose data must report losses, a deliberately broken
//! variant must be caught, and a seed must replay bit for bit. The longer swarm run is
//! `cargo run --release -p sim -- --seeds 5000 --swarm` (docs/testing.md).

use sim::{run, run_many, run_until, Broken, FaultKind, RunReport, SimOptions, Summary};

/// Signatures (matched against a run's *first* violation) of the core bugs the simulator found
/// that are still open (docs/testing.md, "Bugs found"). Such a run is reported, not failed, so
/// CI guards against every *other* breach while a bug is open. Delete an entry when its bug is
/// fixed (and un-ignore its `bug_*` test below); with the list empty, any violation fails CI.
/// Violations explained by a known, still open core bug: (signature, bug). Empty: any
/// violation fails CI.
const KNOWN_CORE_BUGS: &[(&str, &str)] = &[];

fn known_bug(r: &RunReport) -> Option<&'static str> {
    let first = r.violations.first()?;
    KNOWN_CORE_BUGS.iter().find(|(sig, _)| first.contains(sig)).map(|(_, bug)| *bug)
}

/// Run seeds and fail on any violation not explained by a known core bug.
fn sweep(name: &str, base: &SimOptions, seeds: u64) -> Summary {
    let reports = run_many(base, 1_000, seeds, 2);
    let mut summary = Summary::default();
    let mut unexplained = Vec::new();
    let mut known = std::collections::BTreeMap::<&str, Vec<u64>>::new();
    for r in &reports {
        summary.add(r);
        if r.violations.is_empty() {
            continue;
        }
        match known_bug(r) {
            Some(bug) => known.entry(bug).or_default().push(r.seed),
            None => unexplained.push(format!("seed {}: {} — replay: {}", r.seed, r.violations[0], r.replay)),
        }
    }
    eprintln!(
        "{name}: {} runs, {} faults, {} acked writes, {} reads checked, {} ended with no element in sync {:?} ({} of them with peer recovery {:?})",
        summary.runs,
        summary.faults_total(),
        summary.writes_acked,
        summary.reads_checked,
        summary.runs_without_in_sync_at_end,
        summary.runs_without_in_sync_seeds,
        summary.runs_without_in_sync_with_peer_recovery,
        summary.runs_without_in_sync_with_peer_recovery_seeds
    );
    for (bug, seeds) in &known {
        eprintln!("  known core bug {bug}: seeds {seeds:?}");
    }
    assert!(unexplained.is_empty(), "{name}: violations not explained by a known bug:\n{}", unexplained.join("\n"));
    assert!(summary.faults_total() > seeds, "{name}: faults were injected");
    assert!(summary.writes_acked > 0 && summary.reads_checked > 0, "{name}: the workload ran");
    summary
}

/// A broken variant's runs of seeds `first..first + count`, in seed order, stopped once `need`
/// of them are caught (`is_caught` judges a run): the seeds after that could only add catches.
/// Prints the seeds caught and the seeds run; returns the caught ones.
fn catch(
    name: &str,
    o: &SimOptions,
    (first, count): (u64, u64),
    need: usize,
    is_caught: impl Fn(&RunReport) -> bool + Sync,
) -> Vec<u64> {
    let reports = run_until(o, first, count, 2, |rs| rs.iter().filter(|r| is_caught(r)).count() >= need);
    caught_seeds(name, (first, count), &reports, is_caught, "")
}

/// The seeds of `reports` (runs from `first`, `count` at most) that `is_caught` says were
/// caught, printed with the variant's `name` and `more` to say.
fn caught_seeds(
    name: &str,
    (first, count): (u64, u64),
    reports: &[RunReport],
    is_caught: impl Fn(&RunReport) -> bool,
    more: &str,
) -> Vec<u64> {
    let caught: Vec<u64> = reports.iter().filter(|r| is_caught(r)).map(|r| r.seed).collect();
    let end = first + reports.len() as u64;
    eprintln!(
        "--broken {name}: caught seeds {caught:?} of {first}..{end} (enough by then, or {first}..{}){more}",
        first + count
    );
    caught
}

fn any_violation(r: &RunReport) -> bool {
    !r.violations.is_empty()
}

fn options(elements: usize, quorum: usize) -> SimOptions {
    let mut o = SimOptions::new(0, elements, quorum);
    o.fault_phase_ms = 10_000;
    o
}

#[test]
fn seed_sweep_three_elements_quorum_two() {
    sweep("N=3 Q=2", &options(3, 2), 120);
}

#[test]
fn seed_sweep_swarm() {
    let mut o = options(3, 2);
    o.swarm = true;
    sweep("N=3 Q=2 swarm", &o, 50);
}

#[test]
fn seed_sweep_other_shapes() {
    sweep("N=5 Q=3", &options(5, 3), 30);
    sweep("N=2 Q=2", &options(2, 2), 20);
    sweep("N=1 Q=1", &options(1, 1), 20);
}

/// The paper's section 4.2: with Q ≤ N/2, the host element and Q up-to-date elements failing
/// together could lose acknowledged writes, when a new host element started without them.
/// Since a host element starts only with N−Q+1 elements (issue 12: a set that meets every
/// write quorum), it waits for enough of them to come back, and nothing is lost while they do
/// (a loss now needs their disks gone). The disasters must happen, and lose nothing.
#[test]
fn quorum_at_most_half_loses_nothing_while_the_elements_come_back() {
    for (n, q) in [(3, 1), (4, 2)] {
        let summary = sweep(&format!("N={n} Q={q}"), &options(n, q), 25);
        eprintln!(
            "N={n} Q={q}: {} host-and-Q-elements disasters, {} acknowledged writes lost",
            summary.faults.get("host_and_q_elements_crash").copied().unwrap_or(0),
            summary.acked_writes_lost_allowed
        );
        assert!(summary.faults.get("host_and_q_elements_crash").copied().unwrap_or(0) > 0, "N={n} Q={q}: disasters");
        assert_eq!(summary.acked_writes_lost_allowed, 0, "N={n} Q={q}");
    }
}

/// Elements that acknowledge before their fdatasync: every run must be caught.
#[test]
fn broken_variant_ack_before_sync_is_caught() {
    let mut o = options(3, 2);
    o.broken = Broken::AckBeforeSync;
    for r in run_many(&o, 0, 10, 2) {
        assert!(
            r.violations.iter().any(|v| v.contains("hold it durably, fewer than Q")),
            "seed {} not caught: {:?}",
            r.seed,
            r.violations.first()
        );
    }
}

/// A host element superseded while it still runs (only that fault): the elements fence it,
/// so nothing breaks; with elements that do not fence (`--broken no-fencing`) what it still
/// writes after its successor took over mixes into the new history, and the checkers see it.
#[test]
fn superseded_host_element_is_fenced_and_no_fencing_is_caught() {
    let mut o = options(3, 2);
    o.only_faults = vec![FaultKind::HostSuperseded];
    let summary = sweep("N=3 Q=2 host_superseded only", &o, 12);
    assert!(summary.faults["host_superseded"] >= 12);
    o.broken = Broken::NoFencing;
    let caught = catch("no-fencing", &o, (1_000, 24), 8, any_violation);
    assert!(caught.len() >= 8, "no-fencing caught in only {} of 24 runs", caught.len());
}

#[test]
fn same_seed_same_run() {
    for (seed, swarm) in [(7, false), (8, true)] {
        let mut o = options(3, 2);
        o.seed = seed;
        o.swarm = swarm;
        let (a, b) = (run(&o), run(&o));
        assert_eq!(a.digest, b.digest, "seed {seed}");
        assert_eq!(
            (a.events, a.requests, a.faults_total(), a.violations.len()),
            (b.events, b.requests, b.faults_total(), b.violations.len())
        );
    }
}

// ----- one replay per core bug found (docs/testing.md) ----------------------------------------
//
// Seeds replay the same run only while the core and the simulator are unchanged; each seed
// below was checked to fail with its bug's signature against the core before the fix (commit
// 2ac993a's `crates/core`, or for bug 1 the element's old store-wide fencing) and to pass now.

fn replay(seed: u64, elements: usize, quorum: usize) -> RunReport {
    let r = run(&SimOptions::new(seed, elements, quorum));
    assert!(
        r.violations.is_empty(),
        "{} violation(s), first: {}\nreplay: {}",
        r.violations.len(),
        r.violations[0],
        r.replay
    );
    r
}

/// Bug 1 (fixed by session-level fencing in the element and per-volume fencing in the store):
/// roll-forward records of an older epoch reach a volume after another volume moved on.
/// (Seed 48 until issue 12 changed the heartbeat and start-up rules, then 18 until copies
/// waited for a source instead of failing their element; 16 reaches the situation now, and was
/// not replayed against the pre-fix store.)
#[test]
fn bug_1_rolled_forward_records_accepted_after_another_volume_moved_on() {
    let r = replay(16, 3, 2);
    assert!(r.records_applied_behind_another_volume > 0, "the seed no longer reaches the situation");
}

/// Bug 2 (fixed by the epoch check at the write-queue base and the start-up source chosen by
/// (epoch, sequence)): an element holding an older epoch's record at the queue base is
/// refused as diverged instead of being admitted.
#[test]
fn bug_2_diverged_element_at_the_queue_base_is_refused() {
    let r = replay(485, 3, 2);
    assert!(r.diverged_elements_refused > 0, "the seed no longer reaches the situation");
}

/// Bug 3 (fixed by a handshake deadline): an element that dies silently before its Welcome
/// is failed and reconnected.
#[test]
fn bug_3_handshake_with_a_silently_dead_element_times_out() {
    let r = replay(417, 3, 2);
    assert!(r.handshake_timeouts > 0, "the seed no longer reaches the situation");
}

/// Bug 4 (fixed): an element whose last record is a never-acknowledged record of an older
/// epoch, and whose gap left the write queue, was replayed from a peer without any epoch check
/// and declared in sync with a diverged history. The replay now checks that record first.
#[test]
fn bug_4_diverged_element_admitted_by_replay_recovery() {
    replay(109, 3, 2);
}

/// Bug 7 (fixed, docs/testing.md): under weaker ack policies, a weakly acknowledged write that
/// one host element's start did without came back at a later start (reads went back in time,
/// then forward). A host element now begins every volume with a record of its epoch, and with
/// weaker ack policies serves reads once Q elements hold it. These seeds failed before (stale
/// reads, holes, a diverged element in sync, a lost write); seed 532 with network-sync also
/// needed a replay that a superseded host element ordered to stop once a newer epoch is adopted.
#[test]
fn bug_7_a_write_a_start_did_without_stays_out() {
    use starfish_core::AckPolicy::{Durable, NetworkSync, Received};
    let cases: [(u64, [starfish_core::AckPolicy; 3]); 7] = [
        (8, [Durable, Received, NetworkSync]),
        (324, [Durable, Received, NetworkSync]),
        (626, [Durable, Received, NetworkSync]),
        (538, [Received, Received, Durable]),
        (812, [Received, Received, Durable]),
        (36, [NetworkSync, Durable, Durable]),
        (532, [NetworkSync, Durable, Durable]),
    ];
    for (seed, ack) in cases {
        let mut o = SimOptions::new(seed, 3, 2);
        o.swarm = true;
        o.ack = ack.to_vec();
        let r = run(&o);
        assert!(r.violations.is_empty(), "seed {seed} {ack:?}: {:?} — replay: {}", r.violations.first(), r.replay);
    }
}

/// A host element that leaves out its beginning records (`--broken no-begin`) must be caught:
/// with weaker ack policies a later start brings back what reads did not show.
#[test]
fn leaving_out_beginnings_is_caught() {
    let mut o = SimOptions::new(0, 3, 2);
    o.swarm = true;
    o.ack = vec![
        starfish_core::AckPolicy::Durable,
        starfish_core::AckPolicy::Received,
        starfish_core::AckPolicy::NetworkSync,
    ];
    o.broken = Broken::NoBegin;
    let caught = catch("no-begin", &o, (600, 150), 2, any_violation);
    assert!(caught.len() >= 2, "leaving out beginnings must be caught in several runs, got {caught:?}");
}

/// Host elements start with skewed, frozen and cloned clocks (every host element start draws
/// its first epoch offer from them). Raising the epoch above what the elements follow makes
/// every start succeed; a host element that keeps its clock's epoch (`--broken clock-epochs`,
/// the way epochs were taken before) is refused for good once its clock is behind, and the
/// liveness checker must see it.
#[test]
fn clock_skew_is_harmless_and_clock_epochs_are_caught() {
    let mut o = options(3, 2);
    o.only_faults = vec![FaultKind::HostCrash, FaultKind::HostSuperseded, FaultKind::ElementKill];
    let summary = sweep("N=3 Q=2 host restarts with skewed clocks", &o, 16);
    assert!(summary.epoch_raises > 0, "starts that had to raise their epoch happened");
    o.broken = Broken::ClockEpochs;
    let caught = catch("clock-epochs", &o, (1_000, 16), 4, any_violation);
    assert!(caught.len() >= 4, "clock epochs must be caught in several runs, got {caught:?}");
}

/// Failover (issue 12): a host element paused past its read lease while a standby takes over
/// (its clients split between the two), or superseded while it runs, acknowledges nothing in
/// the new one's epoch and answers no stale read; without the read lease it does.
#[test]
fn takeovers_are_safe_and_reads_without_the_lease_are_caught() {
    let mut o = options(3, 2);
    o.only_faults = vec![FaultKind::HostPause, FaultKind::HostSuperseded, FaultKind::ElementKill];
    let summary = sweep("N=3 Q=2 paused and superseded host elements", &o, 16);
    assert!(summary.host_starts > 16, "takeovers happened");
    o.broken = Broken::NoReadLease;
    let caught = catch("no-read-lease", &o, (2_000, 16), 2, any_violation);
    assert!(caught.len() >= 2, "reads without the lease must be caught in several runs, got {caught:?}");
}

/// A clean stop of the host element (`host_stop`, as `Node::stop` on SIGTERM): it answers what
/// it took, sends `Release` and exits, and the next one starts without waiting for the read
/// lease to lapse: nothing acknowledged is lost and no read is stale. One that releases while
/// it still serves (`--broken release-while-serving`) is caught serving from its cache what
/// the next one has overwritten.
#[test]
fn clean_stops_let_the_elements_go_and_releasing_while_serving_is_caught() {
    let mut o = options(3, 2);
    o.only_faults = vec![FaultKind::HostStop, FaultKind::ElementKill, FaultKind::HostCrash];
    o.fault_interval_ms = 300.0;
    let summary = sweep("N=3 Q=2 clean stops of the host element", &o, 16);
    assert!(summary.faults.get("host_stop").copied().unwrap_or(0) > 16, "stops happened: {:?}", summary.faults);
    // The broken variant's window is short: the new host element must be serving writes before
    // the old one's own lease lapses (seeds 0-79 of stops alone: 4 caught; since a block a read
    // missed enters the read cache only when a read misses it again, fewer stale blocks are
    // cached: 44 and 110 of 0-110).
    o.only_faults = vec![FaultKind::HostStop];
    o.broken = Broken::ReleaseWhileServing;
    let caught = catch("release-while-serving", &o, (0, 240), 2, any_violation);
    assert!(caught.len() >= 2, "a release while serving must be caught in several runs, got {caught:?}");
}

/// A session holding an element's certificate (a compromised element) that tries what only a
/// host element may — a newer epoch, writes at the next sequences — changes nothing; without
/// the element's role check it fences host elements and plants content nobody wrote.
#[test]
fn rogue_element_sessions_change_nothing_and_without_the_role_check_are_caught() {
    let mut o = options(3, 2);
    o.only_faults = vec![FaultKind::RogueElementSession, FaultKind::ElementKill, FaultKind::HostCrash];
    let summary = sweep("N=3 Q=2 rogue element sessions", &o, 16);
    assert!(summary.faults_total() > 16, "rogue sessions happened");
    o.broken = Broken::NoRoleCheck;
    let caught = catch("no-role-check", &o, (3_000, 32), 6, any_violation);
    assert!(caught.len() >= 6, "a missing role check must be caught in several runs, got {caught:?}");
}

/// Scrub (issue 13): a block that silently diverges on one element, checksum and all, is
/// found by the host element's scrubs (every second in these runs) and repaired, so that the
/// replicas in sync end identical and the final read-back sees no diverged block; without the
/// repair (`--broken no-scrub-repair`) the checkers see the replicas differ.
#[test]
fn silent_divergence_is_repaired_by_scrub_and_without_the_repair_is_caught() {
    let mut o = options(3, 2);
    o.only_faults = vec![FaultKind::DivergeBlock, FaultKind::ElementKill, FaultKind::HostCrash];
    o.fault_interval_ms = 300.0;
    let summary = sweep("N=3 Q=2 silent divergence and scrub", &o, 16);
    assert!(summary.faults.get("diverge_block").is_some_and(|n| *n > 0), "divergences were injected");
    assert!(summary.scrubs_done > 0 && summary.scrub_repairs > 0, "scrubs ran and repaired");
    o.broken = Broken::NoScrubRepair;
    let caught = catch("no-scrub-repair", &o, (6_000, 16), 6, any_violation);
    assert!(caught.len() >= 6, "a scrub that repairs nothing must be caught in several runs, got {caught:?}");
}

/// Ack policies (issue 14): with `received` and `network-sync` elements counting toward Q, a
/// write may be lost only if the elements that counted for it crash before Q store it, and
/// never once a FLUSH answered after it; a `local-sync` element never counts (a volume whose
/// counting elements fall below Q is read-only, which the simulator found the core got wrong:
/// it counted the local-sync element and left writes waiting). A FLUSH answered before Q
/// durable copies (`--broken flush-before-durable`) is caught.
#[test]
fn weaker_ack_policies_keep_their_promise_and_an_early_flush_is_caught() {
    use starfish_core::AckPolicy::{Durable, LocalSync, NetworkSync, Received};
    let mut o = options(3, 2);
    o.ack = vec![Received, NetworkSync, Durable];
    let summary = sweep("N=3 Q=2 received, network-sync, durable", &o, 16);
    eprintln!("  acknowledged writes lost within the weaker promise: {}", summary.acked_writes_lost_allowed);
    o.ack = vec![Durable, Durable, LocalSync];
    sweep("N=3 Q=2 durable, durable, local-sync", &o, 16);
    o.ack = vec![Received, Received, Durable];
    o.broken = Broken::FlushBeforeDurable;
    let caught = catch("flush-before-durable", &o, (7_000, 16), 2, any_violation);
    assert!(caught.len() >= 2, "a flush before Q durable copies must be caught, got {caught:?}");
}

/// Consistency groups (issue 14): vol0 and vol1 carried as one storage volume by the real
/// `starfish_core::groups::layout`, exported as windows of it; every element's copy of the
/// group stays a prefix of one order under every fault, with weaker ack policies too. A host
/// element that carries each member on its own (`--broken split-group`: two sequence spaces,
/// recovered one after the other) is caught.
#[test]
fn consistency_groups_keep_one_order_and_split_groups_are_caught() {
    use starfish_core::AckPolicy::{Durable, LocalSync, NetworkSync, Received};
    let mut o = options(3, 2);
    o.groups = true;
    let summary = sweep("N=3 Q=2 groups", &o, 24);
    assert!(summary.group_states_checked > 0, "the group order was judged");
    o.ack = vec![Received, Durable, LocalSync];
    sweep("N=3 Q=2 groups, received, durable, local-sync", &o, 16);
    o.ack = vec![NetworkSync, Durable, Durable];
    o.broken = Broken::SplitGroup;
    let caught =
        catch("split-group", &o, (8_000, 16), 4, |r| r.violations.iter().any(|v| v.contains("no prefix of one order")));
    assert!(caught.len() >= 4, "members carried apart must be caught breaking the group's order, got {caught:?}");
}

/// Volumes created while running (issue 15): the real catalog and intention log over the
/// catalog's storage volume, host element crashes at random steps of creations (as the real
/// tests' failpoints) among the usual faults. An acknowledged creation is never lost and no
/// element keeps a volume no catalog names; without the intention log (`--broken
/// no-intention-log`, the Slice paper's NONE) both happen.
#[test]
fn volume_creations_are_failure_atomic_and_without_the_intention_log_are_caught() {
    let mut o = options(3, 2);
    o.volume_ops = true;
    let summary = sweep("N=3 Q=2 volume ops", &o, 24);
    assert!(summary.volumes_created > 0, "volumes were created");
    assert!(summary.volumes_deleted > 0, "volumes were deleted");
    o.broken = Broken::NoIntentionLog;
    o.fault_phase_ms = 20_000;
    // An orphan, a lost creation, a deleted volume back, or a new volume holding an orphan's
    // data (without the log, a crash reuses its id, so its storage name).
    let signs = ["orphaned volumes", "is lost: the catalog", "is served again", "misplaced"];
    let caught = catch("no-intention-log", &o, (9_000, 48), 3, |r| {
        r.violations.iter().any(|v| signs.iter().any(|s| v.contains(s)))
    });
    assert!(caught.len() >= 3, "creations without the intention log must be caught, got {caught:?}");
}

/// Weak ack policies with volume operations: writes acknowledged on receipts, lost by a power
/// loss of the elements that counted (as the contract allows), on a volume deleted later. Seed
/// 55 once read them back stale before the deletion and never counted them lost (the volume's
/// history was checked only at the end, when it was gone): the checker now accounts a
/// volume's acknowledged writes before its deletion is logged. Seed 709 is such a run since
/// the read window, the read cache's bypass and the lease fix changed the runs (seed 55
/// deletes nothing now, nor loses seed 850, the one before), and seed 1131 since host elements
/// begin with a record (bug 7): of seeds 0–1500 the ones whose `--trace` says "lost as allowed
/// (before its volume's deletion)" were 1131 and 1151. Since a block a read missed enters the
/// read cache only when a read misses it again, of seeds 1100–1500 only 1151 does.
#[test]
fn weakly_acknowledged_losses_on_a_deleted_volume_are_accounted_for() {
    use starfish_core::AckPolicy::{Durable, NetworkSync, Received};
    let mut o = SimOptions::new(1151, 3, 2);
    o.volume_ops = true;
    o.ack = vec![Received, NetworkSync, Durable];
    let r = run(&o);
    assert!(r.violations.is_empty(), "seed 1151: {:?} — replay: {}", r.violations, r.replay);
    assert!(
        r.volumes_deleted > 0 && r.acked_writes_lost_weak > 0,
        "seed 1151 no longer loses weak writes of a deleted volume"
    );
    o.fault_phase_ms = 10_000;
    sweep("N=3 Q=2 volume ops, received, network-sync, durable", &o, 32);
}

/// Volumes grown while running (issue 15): resizes among the faults and the host element
/// crashes at random steps, writes into the new blocks from the moment the core serves them.
/// A volume never shrinks: every later host element serves it at least at the size it was
/// served (or acknowledged) at. A starting host element that undoes the resizes it finds
/// pending instead of rolling them forward (`--broken forget-resizes`) is caught.
#[test]
fn volume_resizes_roll_forward_and_forgotten_resizes_are_caught() {
    let mut o = options(3, 2);
    o.volume_ops = true;
    o.fault_phase_ms = 20_000;
    let summary = sweep("N=3 Q=2 volume ops (resizes)", &o, 48);
    assert!(summary.volumes_resized > 0, "volumes were grown");
    o.broken = Broken::ForgetResizes;
    let caught =
        catch("forget-resizes", &o, (13_000, 160), 2, |r| r.violations.iter().any(|v| v.contains("it shrank")));
    assert!(caught.len() >= 2, "forgotten resizes must be caught, got {caught:?}");
}

/// Volumes are deleted among the faults (the sweep above deletes some); a starting host
/// element that forgets the deletions it finds pending leaves the volume on an element that
/// was down, which the checker finds.
#[test]
fn forgotten_volume_deletions_are_caught() {
    let mut o = options(3, 2);
    o.volume_ops = true;
    o.broken = Broken::ForgetDeletions;
    o.fault_phase_ms = 20_000;
    let caught =
        catch("forget-deletions", &o, (12_000, 48), 2, |r| r.violations.iter().any(|v| v.contains("orphaned volumes")));
    assert!(caught.len() >= 2, "forgotten deletions must be caught, got {caught:?}");
}

/// A host element that takes the elements back from one that is gone (`Event::Restarted`)
/// reads the catalog again: the one it took them from may have created, deleted or grown
/// volumes since. `HostPause` with volume operations sometimes has the host element that took
/// over change the catalog and crash before the paused one runs again. The broken variant
/// serves the catalog read before the pause, which the checker catches (an acknowledged
/// creation missing, a deleted volume back, an orphan, a shrink). Seeds 883, 1520, 660, 1962
/// and 1030 failed before the fixes found on the way (a late write's holders counted in the
/// running host element's numbering; a volume being copied sent live writes; an element that
/// created the volumes of a hello older than one it was taking; an acknowledged write of a
/// volume no host element served at the end).
#[test]
fn a_takeover_reads_the_catalog_again_and_a_stale_catalog_is_caught() {
    let mut o = SimOptions::new(0, 3, 2);
    o.volume_ops = true;
    o.swarm = true;
    for seed in [883, 1520, 660, 1962, 1030] {
        let r = run(&SimOptions { seed, ..o.clone() });
        assert!(r.violations.is_empty(), "seed {seed}: {:?} — replay: {}", r.violations.first(), r.replay);
    }
    let reports = run_many(&o, 600, 120, 2);
    let failed: Vec<String> = reports
        .iter()
        .filter(|r| !r.violations.is_empty())
        .map(|r| format!("{}: {}", r.seed, r.violations[0]))
        .collect();
    assert!(failed.is_empty(), "correct code, seeds 600..720: {failed:?}");
    o.broken = Broken::StaleCatalog;
    let caught = catch("stale-catalog", &o, (600, 120), 2, any_violation);
    assert!(caught.len() >= 2, "a stale catalog after a takeover must be caught, got {caught:?}");
}

/// A shrink (issue 15) serves the smaller size at once, zeroes what lies past the new end
/// through the ordered stream and acknowledges only then; the checker holds that promise (the
/// newest acknowledged request of every sector past the new end is a zeroing, and a grow back
/// reads those sectors against it). A shrink that keeps its tail must be caught.
#[test]
fn a_shrink_zeroes_its_tail_and_one_that_keeps_it_is_caught() {
    let mut o = SimOptions::new(0, 3, 2);
    o.volume_ops = true;
    let reports = run_many(&o, 14150, 80, 2);
    let failed: Vec<String> = reports
        .iter()
        .filter(|r| !r.violations.is_empty())
        .map(|r| format!("{}: {}", r.seed, r.violations[0]))
        .collect();
    assert!(failed.is_empty(), "correct code, seeds 14150..14230: {failed:?}");
    let shrunk: u64 = reports.iter().map(|r| r.volumes_shrunk).sum();
    assert!(shrunk >= 1, "the runs shrink volumes");
    o.broken = Broken::ShrinkKeepsTail;
    let caught = catch("shrink-keeps-tail", &o, (14150, 80), 2, any_violation);
    assert!(caught.len() >= 2, "a shrink that keeps its tail must be caught, got {caught:?}");
}

/// Snapshots (issue 15) are records in the ordered stream: every element takes one between
/// the same two writes, an element that catches up takes it in its replay, and a snapshot never
/// changes after it was taken. The checker holds each snapshot read to the volume as it was at
/// the snapshot's record, and every later read of a sector to the first; a snapshot that
/// preserves nothing (it reads its live volume) must be caught.
#[test]
fn a_snapshot_never_changes_and_one_that_shares_its_live_volume_is_caught() {
    let mut o = SimOptions::new(0, 3, 2);
    o.snapshots = true;
    let reports = run_many(&o, 15000, 40, 2);
    let failed: Vec<String> = reports
        .iter()
        .filter(|r| !r.violations.is_empty())
        .map(|r| format!("{}: {}", r.seed, r.violations[0]))
        .collect();
    assert!(failed.is_empty(), "correct code, seeds 15000..15040: {failed:?}");
    let (taken, judged): (u64, u64) =
        reports.iter().fold((0, 0), |(t, j), r| (t + r.snapshots_taken, j + r.snapshot_reads_checked));
    assert!(taken >= 100 && judged >= 100, "the runs take and read snapshots: {taken} taken, {judged} reads judged");
    o.broken = Broken::SnapshotSharesLive;
    let caught = catch("snapshot-shares-live", &o, (15000, 40), 20, any_violation);
    assert!(caught.len() >= 20, "a snapshot that shares its live volume must be caught, got {caught:?}");
}

#[test]
fn a_clone_reads_as_its_snapshot_and_one_created_empty_is_caught() {
    let mut o = SimOptions::new(0, 3, 2);
    o.snapshots = true;
    o.volume_ops = true;
    let reports = run_many(&o, 16000, 40, 2);
    let failed: Vec<String> = reports
        .iter()
        .filter(|r| !r.violations.is_empty())
        .map(|r| format!("{}: {}", r.seed, r.violations[0]))
        .collect();
    assert!(failed.is_empty(), "correct code, seeds 16000..16040: {failed:?}");
    let (clones, reads): (u64, u64) =
        reports.iter().fold((0, 0), |(c, n), r| (c + r.clones_created, n + r.clone_reads));
    assert!(clones >= 10 && reads >= 1000, "the runs make and read clones: {clones} made, {reads} reads");
    o.broken = Broken::CloneStartsEmpty;
    let caught = catch("clone-starts-empty", &o, (16000, 40), 12, any_violation);
    assert!(caught.len() >= 12, "a clone created empty must be caught, got {caught:?}");
}

/// Issue 15: volumes that join the consistency group while running (`--groups --volume-ops`)
/// are windows of its storage volume: the group checker holds them to the group's one order,
/// and a run with them is clean. With `--broken join-split` a joining volume gets a storage
/// volume (a sequence space) of its own: the group checker must find an element's copy of the
/// group that is no prefix of one order. With `--broken leave-keeps-data` a member's deletion
/// does not zero its window: the deletion's check must find a write still there.
#[test]
fn a_volume_that_joins_a_group_shares_its_order_and_one_split_off_is_caught() {
    let mut o = SimOptions::new(0, 3, 2);
    o.groups = true;
    o.volume_ops = true;
    let reports = run_many(&o, 17000, 40, 2);
    let failed: Vec<String> = reports
        .iter()
        .filter(|r| !r.violations.is_empty())
        .map(|r| format!("{}: {}", r.seed, r.violations[0]))
        .collect();
    assert!(failed.is_empty(), "correct code, seeds 17000..17040: {failed:?}");
    let joined: u64 = reports.iter().map(|r| r.volumes_joined).sum();
    assert!(joined >= 10, "the runs join volumes to the group: {joined}");
    o.broken = Broken::JoinSplit;
    let order = |r: &&RunReport| r.violations.iter().any(|v| v.contains("no prefix of one order"));
    let reports = run_until(&o, 17000, 40, 2, |rs| {
        rs.iter().filter(|r| any_violation(r)).count() >= 12 && rs.iter().filter(order).count() >= 3
    });
    let by_order: Vec<u64> = reports.iter().filter(order).map(|r| r.seed).collect();
    let more = format!(", by the group checker {by_order:?}");
    let caught = caught_seeds("join-split", (17000, 40), &reports, any_violation, &more);
    // The others by the catalog's checker: the split-off storage volume is an orphan.
    assert!(caught.len() >= 12, "a joined volume outside the group's order must be caught, got {caught:?}");
    assert!(by_order.len() >= 3, "the group checker must see it, got {by_order:?}");
    // A member's deletion keeps its data (a FLUSH stands in for the zeroing of its window):
    // caught when the deletion is acknowledged. Rarer (a member written, then deleted), so
    // over more seeds.
    o.broken = Broken::LeaveKeepsData;
    let caught = catch("leave-keeps-data", &o, (17000, 200), 8, any_violation);
    assert!(caught.len() >= 8, "a member deleted with its data must be caught, got {caught:?}");
}

#[test]
fn reads_out_at_an_element_are_bounded_so_its_pongs_keep_the_read_lease() {
    // Seed 25 with groups and volume operations ends (one element failed for good) with a
    // burst of verification reads, all to the closest element: unbounded, its pongs queue
    // behind about 10 MiB of replies on its 100 Mb/s link, the read lease lapses and reads
    // fail with two of Q=2 elements in sync (the liveness checker). Bounded by the host
    // element's read window, the same schedule passes.
    let mut o = SimOptions::new(25, 3, 2);
    o.groups = true;
    o.volume_ops = true;
    let r = run(&o);
    assert!(r.violations.is_empty(), "bounded reads: {:?} — replay: {}", r.violations.first(), r.replay);
    o.broken = Broken::UnboundedReads;
    let r = run(&o);
    let lapsed = |v: &String| v.starts_with("liveness:") && v.contains("(Read) failed with Unavailable");
    assert!(r.violations.iter().any(lapsed), "--broken unbounded-reads must be caught, got {:?}", r.violations);
}

#[test]
fn a_host_element_starts_only_with_elements_that_hold_their_volumes() {
    // Swarm seed 273, once interrupted copies were modelled (the store's copy state file): an
    // element turned repair (a bad block), its repair copy failed (the source had a bad block
    // too) and left it holding nothing consistent; the host element restarted with it and an
    // element behind as its start-up set, without the one that held writes 566..773, and those
    // acknowledged writes were lost. It now counts a volume's holders only. Since host elements
    // begin with a record (bug 7) the runs changed and no swarm seed of 0–2999 reaches that
    // schedule without the fix (checked by taking it out); the core test
    // `a_starting_host_element_does_not_count_an_element_being_copied` guards it. These seeds
    // interrupt copies and must run clean (56, 144 and 285 no longer did once a source's bad
    // block failed only the copies that need it; 117 and 129 do).
    for seed in [82, 117, 129, 269] {
        let mut o = SimOptions::new(seed, 3, 2);
        o.swarm = true;
        let r = run(&o);
        assert!(r.copies_interrupted > 0, "seed {seed}: the schedule interrupts a copy");
        assert!(r.violations.is_empty(), "seed {seed}: {:?} — replay: {}", r.violations.first(), r.replay);
    }
}

#[test]
fn forgetting_that_a_copy_began_is_caught() {
    // An element that forgets, when it restarts, that a full recovery's copy had begun
    // reports what it held before, though copied blocks overwrote a part of it.
    let mut o = SimOptions::new(0, 3, 2);
    o.swarm = true;
    o.broken = Broken::ForgetCopyState;
    // Seeds 1000-1099 caught it until a block a read missed entered the read cache only when a
    // read missed it again; of 1000-1599 then, 1338 alone.
    let reports = run_until(&o, 1300, 100, 2, |rs| rs.iter().any(any_violation));
    let interrupted: u64 = reports.iter().map(|r| r.copies_interrupted).sum();
    let more = format!(", {interrupted} copies interrupted");
    let caught = caught_seeds("forget-copy-state", (1300, 100), &reports, any_violation, &more);
    assert!(!caught.is_empty(), "an element that forgets its copy state must be caught");
}

/// Run swarm seed `seed` (N=3, Q=2): no violation, and at least two elements in sync at the
/// end. Returns its options, for broken variants of the same run.
fn swarm_seed_ends_in_sync(seed: u64) -> SimOptions {
    let mut o = SimOptions::new(seed, 3, 2);
    o.swarm = true;
    let r = run(&o);
    assert!(r.violations.is_empty(), "seed {seed}: {:?}", r.violations);
    assert!(r.elements_in_sync_at_end >= 2, "seed {seed} ended with {} element(s) in sync", r.elements_in_sync_at_end);
    o
}

/// Seed 702546 ended with every element failed for good: e0 and e1 needed vol0's newest record,
/// which only e2 held, and e2 needed vol1 copied from e0 or e1, which were failed as a whole
/// (no element was in sync, so none could serve a copy or a replay). Now, while no element is
/// in sync, a copy comes from a peer the write queue streams the volume to, and an element
/// that needs a copy nobody can serve waits connected instead of failing: the run ends with
/// elements in sync.
#[test]
fn elements_that_each_hold_what_another_needs_recover_with_none_in_sync() {
    let mut o = swarm_seed_ends_in_sync(702_546);
    // Copying from a peer whose volume is not on the current history loses acknowledged writes.
    o.broken = Broken::AnyCopySource;
    let caught = catch("any-copy-source", &o, (700_000, 400), 1, any_violation);
    assert!(!caught.is_empty(), "copies from any peer while none is in sync must be caught");
}

/// Seed 700147 ended with every element holding vol0 with a bad block it had found (a
/// repair), each at its own place: no element in sync, and no copy source, since a repair was
/// none. A repair its element made itself keeps its block map and log as committed, so it now
/// serves copies of the blocks that pass their checksum, the most advanced one to the others:
/// the run ends with elements in sync.
#[test]
fn elements_that_each_found_a_bad_block_in_the_same_volume_repair_each_other() {
    swarm_seed_ends_in_sync(700_147);
}

/// A run that ends with no element in sync is judged volume by volume, against the element a
/// starting host element would continue each volume from. Seed 700008 ends so: its host
/// elements have no peer addresses (no replay or copy between elements), and every element ends
/// failed with a block that fails its checksum. Judged by one element for all volumes, the one
/// with the newest epoch anywhere, the checker reports 30 acknowledged writes lost (so did
/// seed 702546, before the core recovered it: below).
#[test]
fn a_run_that_ends_with_no_element_in_sync_is_judged_volume_by_volume() {
    let mut o = SimOptions::new(700_008, 3, 2);
    o.swarm = true;
    let r = run(&o);
    assert_eq!(r.elements_in_sync_at_end, 0, "seed 700008 still ends with no element in sync");
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    // Judged so, losses still show: with elements that acknowledge before their fdatasync,
    // seed 37 ends with no element in sync too, and acknowledged writes are missing from the
    // histories a starting host element would continue (seed 56 did, until repairs served
    // copies).
    let mut o = SimOptions::new(37, 3, 2);
    o.swarm = true;
    o.broken = Broken::AckBeforeSync;
    let r = run(&o);
    assert_eq!(r.elements_in_sync_at_end, 0, "seed 37 of ack-before-sync still ends with no element in sync");
    let lost = |v: &String| v.contains("is not in the history the replicas ended with");
    assert!(r.violations.iter().any(lost), "acknowledged writes lost must be seen: {:?}", r.violations.first());
}
