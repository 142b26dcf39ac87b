//! What a run found, and the summary of many runs (human text and JSON).

use std::collections::BTreeMap;
use std::fmt::Write as _;

#[derive(Clone, Debug, Default)]
pub struct RunReport {
    pub seed: u64,
    pub replay: String,
    /// The host elements knew the elements' addresses: elements could replay and copy from
    /// each other (the swarm turns it off in some runs).
    pub peer_recovery: bool,
    /// Contract breaches.
    pub violations: Vec<String>,
    /// Acknowledged writes not in the history the replicas ended with, allowed or not.
    pub acked_writes_lost: u64,
    /// Of those, the ones the contract allows (Q ≤ N/2, host element and every holder failed
    /// together).
    pub acked_writes_lost_allowed: u64,
    /// Of those, writes answered on `received` / `network-sync` acknowledgements whose elements
    /// crashed before Q stored them.
    pub acked_writes_lost_weak: u64,
    pub faults: BTreeMap<&'static str, u64>,
    pub requests: u64,
    pub writes_acked: u64,
    pub reads_checked: u64,
    pub sectors_checked: u64,
    pub host_starts: u64,
    /// Takeovers by the simulated standby (`host_crash_standby_takes_over`).
    pub standby_takeovers: u64,
    /// Times a host element started over above an epoch whose owner was gone.
    pub host_restarts: u64,
    /// Times a starting host element raised its epoch above what an element followed.
    pub epoch_raises: u64,
    pub recoveries: BTreeMap<String, u64>,
    pub elements_in_sync_at_end: u64,
    /// Elements left failed at the end for a reason the core documents as needing a recovery
    /// it does not implement (replay or full), or a diverged history.
    pub elements_needing_recovery: u64,
    pub torn_records: u64,
    pub unsynced_records_lost: u64,
    /// Full-recovery copies that stopped part-way (failed, or cut by a crash).
    pub copies_interrupted: u64,
    /// Records elements applied with an epoch older than another volume's last record there
    /// (what the old store-wide fencing refused).
    pub records_applied_behind_another_volume: u64,
    /// Elements the current host element failed for not answering a handshake (the fix of
    /// core bug 3 at work).
    pub handshake_timeouts: u64,
    /// Elements the current host element found with a diverged history, and did not bring
    /// forward by records but sent to a full recovery (the check of core bug 2's fix, among
    /// others).
    pub diverged_elements_refused: u64,
    /// Longest stretch during which the core's `poll_timeout` stayed in the past (a shell
    /// that sleeps until it would spin).
    pub past_deadline_ms_max: u64,
    /// Scrubs the host elements finished, and elements they failed for a repair.
    pub scrubs_done: u64,
    pub scrub_repairs: u64,
    /// Reads (before the final probe) that returned a silently diverged block: not judged,
    /// as nothing but a scrub can tell such a block from the right one.
    pub diverged_reads_unjudged: u64,
    /// Times an element's copy of the consistency group changed and was judged against the
    /// group's one order with something to check (`--groups`).
    pub group_states_checked: u64,
    /// Volumes created while running and acknowledged to the operator (`--volume-ops`).
    pub volumes_created: u64,
    /// Volumes deleted while running, acknowledged (removed from every live element).
    pub volumes_deleted: u64,
    /// Volumes grown while running, acknowledged (Q elements hold the new size).
    pub volumes_resized: u64,
    /// Volumes shrunk while running, acknowledged (their tails zeroed).
    pub volumes_shrunk: u64,
    /// Snapshots taken and acknowledged, deleted and acknowledged, and snapshot reads judged
    /// (`--snapshots`).
    pub snapshots_taken: u64,
    pub snapshots_deleted: u64,
    pub snapshot_reads_checked: u64,
    /// Clones created and acknowledged, and reads of clones (judged as reads of their
    /// snapshots) (`--snapshots --volume-ops`).
    pub clones_created: u64,
    pub clone_reads: u64,
    /// Volumes that joined the consistency group while running, acknowledged (`--groups
    /// --volume-ops`).
    pub volumes_joined: u64,
    pub sim_ms: u64,
    pub events: u64,
    pub digest: u64,
    /// Observations that are not contract breaches, worth a look.
    pub notes: Vec<String>,
}

impl RunReport {
    pub fn faults_total(&self) -> u64 {
        self.faults.values().sum()
    }
}

#[derive(Clone, Debug, Default)]
pub struct Summary {
    pub runs: u64,
    pub runs_failed: u64,
    pub violations: u64,
    pub acked_writes_lost: u64,
    pub acked_writes_lost_allowed: u64,
    pub faults: BTreeMap<&'static str, u64>,
    pub requests: u64,
    pub writes_acked: u64,
    pub reads_checked: u64,
    pub host_starts: u64,
    pub standby_takeovers: u64,
    pub host_restarts: u64,
    pub epoch_raises: u64,
    pub recoveries: BTreeMap<String, u64>,
    pub elements_needing_recovery: u64,
    /// Runs that ended with no element in sync, every volume unavailable after the faults
    /// healed (each element failed for a recovery the core does not implement).
    pub runs_without_in_sync_at_end: u64,
    /// The first few of those runs' seeds, to replay.
    pub runs_without_in_sync_seeds: Vec<u64>,
    /// Of those runs, the ones whose elements could recover from each other (with no peer
    /// addresses, an element that needs a replay or a copy can never come back), and the first
    /// few of their seeds.
    pub runs_without_in_sync_with_peer_recovery: u64,
    pub runs_without_in_sync_with_peer_recovery_seeds: Vec<u64>,
    pub torn_records: u64,
    pub unsynced_records_lost: u64,
    /// Full-recovery copies that stopped part-way (failed, or cut by a crash).
    pub copies_interrupted: u64,
    pub records_applied_behind_another_volume: u64,
    pub past_deadline_ms_max: u64,
    pub scrubs_done: u64,
    pub scrub_repairs: u64,
    pub diverged_reads_unjudged: u64,
    pub group_states_checked: u64,
    pub volumes_created: u64,
    pub volumes_deleted: u64,
    pub volumes_resized: u64,
    /// Volumes shrunk while running, acknowledged (their tails zeroed).
    pub volumes_shrunk: u64,
    pub snapshots_taken: u64,
    pub snapshots_deleted: u64,
    pub snapshot_reads_checked: u64,
    pub clones_created: u64,
    pub clone_reads: u64,
    /// Volumes that joined the consistency group while running, acknowledged (`--groups
    /// --volume-ops`).
    pub volumes_joined: u64,
    pub sim_ms: u64,
    pub events: u64,
    /// (seed, first violation, count, replay command)
    pub failures: Vec<(u64, String, usize, String)>,
    /// (seed, acked writes lost) of runs that lost acknowledged writes within the contract.
    pub allowed_losses: Vec<(u64, u64)>,
}

impl Summary {
    pub fn add(&mut self, r: &RunReport) {
        self.runs += 1;
        self.violations += r.violations.len() as u64;
        self.acked_writes_lost += r.acked_writes_lost;
        self.acked_writes_lost_allowed += r.acked_writes_lost_allowed;
        for (k, v) in &r.faults {
            *self.faults.entry(k).or_default() += v;
        }
        for (k, v) in &r.recoveries {
            *self.recoveries.entry(k.clone()).or_default() += v;
        }
        self.requests += r.requests;
        self.writes_acked += r.writes_acked;
        self.reads_checked += r.reads_checked;
        self.host_starts += r.host_starts;
        self.standby_takeovers += r.standby_takeovers;
        self.host_restarts += r.host_restarts;
        self.epoch_raises += r.epoch_raises;
        self.elements_needing_recovery += r.elements_needing_recovery;
        if r.elements_in_sync_at_end == 0 {
            self.runs_without_in_sync_at_end += 1;
            if self.runs_without_in_sync_seeds.len() < 8 {
                self.runs_without_in_sync_seeds.push(r.seed);
            }
            if r.peer_recovery {
                self.runs_without_in_sync_with_peer_recovery += 1;
                if self.runs_without_in_sync_with_peer_recovery_seeds.len() < 8 {
                    self.runs_without_in_sync_with_peer_recovery_seeds.push(r.seed);
                }
            }
        }
        self.torn_records += r.torn_records;
        self.copies_interrupted += r.copies_interrupted;
        self.unsynced_records_lost += r.unsynced_records_lost;
        self.records_applied_behind_another_volume += r.records_applied_behind_another_volume;
        self.past_deadline_ms_max = self.past_deadline_ms_max.max(r.past_deadline_ms_max);
        self.scrubs_done += r.scrubs_done;
        self.scrub_repairs += r.scrub_repairs;
        self.diverged_reads_unjudged += r.diverged_reads_unjudged;
        self.group_states_checked += r.group_states_checked;
        self.volumes_created += r.volumes_created;
        self.volumes_deleted += r.volumes_deleted;
        self.volumes_resized += r.volumes_resized;
        self.volumes_shrunk += r.volumes_shrunk;
        self.snapshots_taken += r.snapshots_taken;
        self.snapshots_deleted += r.snapshots_deleted;
        self.snapshot_reads_checked += r.snapshot_reads_checked;
        self.clones_created += r.clones_created;
        self.clone_reads += r.clone_reads;
        self.volumes_joined += r.volumes_joined;
        self.sim_ms += r.sim_ms;
        self.events += r.events;
        if !r.violations.is_empty() {
            self.runs_failed += 1;
            self.failures.push((r.seed, r.violations[0].clone(), r.violations.len(), r.replay.clone()));
        }
        if r.acked_writes_lost_allowed > 0 {
            self.allowed_losses.push((r.seed, r.acked_writes_lost_allowed));
        }
    }

    pub fn faults_total(&self) -> u64 {
        self.faults.values().sum()
    }

    pub fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "runs: {} ({} with violations), simulated time {:.0} s, {} events",
            self.runs,
            self.runs_failed,
            self.sim_ms as f64 / 1000.0,
            self.events
        );
        let _ = writeln!(
            s,
            "requests: {} ({} writes acknowledged, {} reads checked)",
            self.requests, self.writes_acked, self.reads_checked
        );
        let _ = writeln!(s, "faults injected: {}", self.faults_total());
        for (k, v) in &self.faults {
            let _ = writeln!(s, "  {k:<28} {v}");
        }
        let _ = writeln!(
            s,
            "  (records lost unsynced at crashes: {}, torn: {}; full-recovery copies interrupted: {})",
            self.unsynced_records_lost, self.torn_records, self.copies_interrupted
        );
        let _ = writeln!(
            s,
            "host element starts: {} (standby takeovers: {}, epochs raised while starting: {}, restarts above an epoch whose owner is gone: {}); recoveries: {:?}",
            self.host_starts, self.standby_takeovers, self.epoch_raises, self.host_restarts, self.recoveries
        );
        let _ = writeln!(
            s,
            "records applied with an epoch older than another volume's last (refused before bug 1's fix): {}",
            self.records_applied_behind_another_volume
        );
        let _ = writeln!(s, "elements ended failed needing replay/full recovery: {}", self.elements_needing_recovery);
        let _ = writeln!(
            s,
            "runs that ended with no element in sync: {} (seeds {:?}{})",
            self.runs_without_in_sync_at_end,
            self.runs_without_in_sync_seeds,
            if self.runs_without_in_sync_at_end > self.runs_without_in_sync_seeds.len() as u64 { ", …" } else { "" }
        );
        let _ = writeln!(
            s,
            "  of them, with peer recovery (the elements' addresses known): {} (seeds {:?}{})",
            self.runs_without_in_sync_with_peer_recovery,
            self.runs_without_in_sync_with_peer_recovery_seeds,
            if self.runs_without_in_sync_with_peer_recovery
                > self.runs_without_in_sync_with_peer_recovery_seeds.len() as u64
            {
                ", …"
            } else {
                ""
            }
        );
        if self.scrubs_done > 0 {
            let _ = writeln!(
                s,
                "scrubs finished: {} (elements failed for a repair: {}; reads of silently diverged blocks not judged: {})",
                self.scrubs_done, self.scrub_repairs, self.diverged_reads_unjudged
            );
        }
        if self.volumes_created > 0 {
            let _ = writeln!(s, "volumes created while running and acknowledged: {}", self.volumes_created);
            let _ = writeln!(s, "volumes deleted while running and acknowledged: {}", self.volumes_deleted);
            let _ = writeln!(s, "volumes grown while running and acknowledged: {}", self.volumes_resized);
            let _ = writeln!(s, "volumes shrunk while running and acknowledged: {}", self.volumes_shrunk);
        }
        if self.snapshots_taken > 0 {
            let _ = writeln!(
                s,
                "snapshots taken and acknowledged: {}, deleted: {}, snapshot reads judged: {}",
                self.snapshots_taken, self.snapshots_deleted, self.snapshot_reads_checked
            );
        }
        if self.clones_created > 0 {
            let _ = writeln!(
                s,
                "clones created and acknowledged: {}, clone reads (judged as their snapshots' reads): {}",
                self.clones_created, self.clone_reads
            );
        }
        if self.volumes_joined > 0 {
            let _ = writeln!(
                s,
                "volumes that joined the consistency group while running, acknowledged: {}",
                self.volumes_joined
            );
        }
        if self.group_states_checked > 0 {
            let _ = writeln!(
                s,
                "elements' copies of the consistency group judged against its one order: {}",
                self.group_states_checked
            );
        }
        let _ = writeln!(
            s,
            "acknowledged writes lost: {} ({} allowed by the contract)",
            self.acked_writes_lost, self.acked_writes_lost_allowed
        );
        let _ = writeln!(s, "longest stretch with the core's deadline in the past: {} ms", self.past_deadline_ms_max);
        let _ = writeln!(s, "violations: {}", self.violations);
        for (seed, first, count, replay) in &self.failures {
            let _ = writeln!(s, "FAILED seed {seed}: {count} violation(s); first: {first}\n  replay: {replay}");
        }
        s
    }

    pub fn json(&self) -> String {
        let mut s = String::from("{");
        let _ = write!(
            s,
            "\"runs\":{},\"runs_failed\":{},\"violations\":{},\"acked_writes_lost\":{},\"acked_writes_lost_allowed\":{},\"faults_injected\":{},",
            self.runs, self.runs_failed, self.violations, self.acked_writes_lost, self.acked_writes_lost_allowed, self.faults_total()
        );
        s.push_str("\"faults\":{");
        let faults: Vec<String> = self.faults.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
        s.push_str(&faults.join(","));
        s.push_str("},");
        let _ = write!(
            s,
            "\"requests\":{},\"writes_acked\":{},\"reads_checked\":{},\"host_element_starts\":{},\"elements_needing_recovery\":{},\"runs_without_in_sync_at_end\":{},\"runs_without_in_sync_with_peer_recovery\":{},\"unsynced_records_lost\":{},\"torn_records\":{},\"copies_interrupted\":{},\"records_applied_behind_another_volume\":{},\"simulated_seconds\":{:.3},\"events\":{},\"past_deadline_ms_max\":{},\"group_states_checked\":{},\"volumes_created\":{},\"volumes_deleted\":{},\"volumes_resized\":{},\"volumes_shrunk\":{},\"snapshots_taken\":{},\"snapshots_deleted\":{},\"snapshot_reads_checked\":{},",
            self.requests, self.writes_acked, self.reads_checked, self.host_starts, self.elements_needing_recovery, self.runs_without_in_sync_at_end, self.runs_without_in_sync_with_peer_recovery, self.unsynced_records_lost, self.torn_records, self.copies_interrupted, self.records_applied_behind_another_volume, self.sim_ms as f64 / 1000.0, self.events, self.past_deadline_ms_max, self.group_states_checked, self.volumes_created, self.volumes_deleted, self.volumes_resized, self.volumes_shrunk, self.snapshots_taken, self.snapshots_deleted, self.snapshot_reads_checked
        );
        s.push_str("\"failures\":[");
        let failures: Vec<String> = self
            .failures
            .iter()
            .map(|(seed, first, count, replay)| {
                format!(
                    "{{\"seed\":{seed},\"violations\":{count},\"first\":{},\"replay\":{}}}",
                    json_string(first),
                    json_string(replay)
                )
            })
            .collect();
        s.push_str(&failures.join(","));
        s.push_str("]}");
        s
    }
}

pub fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
