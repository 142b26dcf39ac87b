//! What one run simulates: the options given on the command line, and the scenario (sizes,
//! latencies, timeouts, fault rates) drawn from the seed.

use crate::rng::Rng;

/// Every fault the simulator can inject. The weights of the default mix are in
/// [`FaultKind::default_weight`]; swarm runs draw their own per seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FaultKind {
    /// kill -9 of an element process: its page cache survives, its sessions get a reset.
    ElementKill,
    /// Power loss of an element machine: unsynced log writes are lost, the last one may be
    /// torn; silence until it is back.
    ElementPowerLoss,
    /// kill -9 of the host element: its memory (write queue, cache) is gone.
    HostCrash,
    /// The host element and the Q most up-to-date elements fail together (the paper's
    /// section 4.2 case): elements stay down long enough for a new host element to start
    /// without them.
    Disaster,
    /// A TCP reset on one link: both ends see the session break at once.
    LinkReset,
    /// Both directions of a link go silent for a while (no reset: heartbeats notice).
    Partition,
    /// Only host element → element stalls.
    StallToElement,
    /// Only element → host element stalls.
    StallToHost,
    /// Latency ×10–100 and a bandwidth cap on one link.
    SlowLink,
    /// fdatasync ×10–100 slower on one element.
    SlowDisk,
    /// The element's disk is full for a while: commits fail, the store refuses changes until
    /// it is reopened, which the element does by itself once space is free again.
    DiskFull,
    /// A data block's checksum no longer matches (bit rot): reads of it fail.
    CorruptBlock,
    /// A replay-log record's checksum no longer matches: serving it fails.
    CorruptLog,
    /// An element whose newest synced batch every other element holds is killed and one bit
    /// of that batch flips: at the next start it refuses to open (the batch was acknowledged),
    /// the operator runs `starfish element repair`, and it comes back without those records,
    /// every volume waiting for a repair from its peers.
    RotNewestBatch,
    /// A new host element starts (with a newer epoch) while the old one still runs — a
    /// supervisor's false failure detection, or an operator restarting a host element that
    /// only looked dead. The old one keeps its sessions, timers and hosts for 0.2–4 s, then is
    /// killed: what it sends meanwhile must be fenced.
    HostSuperseded,
    /// The host element's process is paused (SIGSTOP) for 0.5–4 s, long past its read lease,
    /// while a standby takes over; then it runs on (its clients still connected, its sessions
    /// open) until it is killed 0.2–3 s later: what it answers after it wakes must be fenced
    /// or current.
    HostPause,
    /// kill -9 of the host element, and no restart: a standby (the real `StandbyCore`)
    /// observes the elements every 100 ms and takes over when they say the host element is
    /// gone and it holds the coordinator's key (a register whose holder's lease lapses 2.5 s
    /// after its death; claimed by compare on its revision).
    HostCrashStandby,
    /// Someone holding an element's certificate (a compromised element, or one of its
    /// operators) opens sessions to elements as a peer would and tries what only a host
    /// element may: a newer epoch, and writes at the next sequences with content nobody wrote.
    /// Opt-in only (`--faults rogue_element_session`): not in the default mix or swarm draws.
    RogueElementSession,
    /// One block of one element silently changes, its checksum with it (a misdirected write,
    /// a firmware bug): only a scrub, comparing the replicas, can find it; runs with it scrub
    /// every second. Only where every other element holds that block alike, so a majority
    /// knows the right content. Opt-in only (`--faults diverge_block`).
    DivergeBlock,
    /// A clean stop of the host element (SIGTERM), as the shell's `Node::stop` does it: it
    /// takes no new request, waits at most 2 s for those under way to be answered, sends
    /// `Release` to every element (their read lease ends at once) and closes its sessions;
    /// the next host element starts 0–500 ms later, without waiting for a lease to lapse.
    /// Opt-in only (`--faults host_stop`).
    HostStop,
}

impl FaultKind {
    pub const ALL: [FaultKind; 20] = [
        FaultKind::ElementKill,
        FaultKind::ElementPowerLoss,
        FaultKind::HostCrash,
        FaultKind::Disaster,
        FaultKind::LinkReset,
        FaultKind::Partition,
        FaultKind::StallToElement,
        FaultKind::StallToHost,
        FaultKind::SlowLink,
        FaultKind::SlowDisk,
        FaultKind::DiskFull,
        FaultKind::CorruptBlock,
        FaultKind::CorruptLog,
        FaultKind::HostSuperseded,
        FaultKind::RotNewestBatch,
        FaultKind::HostPause,
        FaultKind::HostCrashStandby,
        FaultKind::RogueElementSession,
        FaultKind::DivergeBlock,
        FaultKind::HostStop,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::ElementKill => "element_kill",
            FaultKind::ElementPowerLoss => "element_power_loss",
            FaultKind::HostCrash => "host_crash",
            FaultKind::Disaster => "host_and_q_elements_crash",
            FaultKind::LinkReset => "link_reset",
            FaultKind::Partition => "partition",
            FaultKind::StallToElement => "one_way_stall_to_element",
            FaultKind::StallToHost => "one_way_stall_to_host",
            FaultKind::SlowLink => "slow_link",
            FaultKind::SlowDisk => "slow_disk",
            FaultKind::DiskFull => "disk_full",
            FaultKind::CorruptBlock => "corrupt_block",
            FaultKind::CorruptLog => "corrupt_log_record",
            FaultKind::RotNewestBatch => "rot_newest_log_batch",
            FaultKind::HostSuperseded => "host_superseded",
            FaultKind::HostPause => "host_pause",
            FaultKind::HostCrashStandby => "host_crash_standby_takes_over",
            FaultKind::RogueElementSession => "rogue_element_session",
            FaultKind::DivergeBlock => "diverge_block",
            FaultKind::HostStop => "host_stop",
        }
    }

    pub fn parse(name: &str) -> Option<FaultKind> {
        FaultKind::ALL.into_iter().find(|k| k.name() == name)
    }

    fn default_weight(self) -> f64 {
        match self {
            FaultKind::ElementKill => 3.0,
            FaultKind::ElementPowerLoss => 3.0,
            FaultKind::HostCrash => 1.5,
            FaultKind::Disaster => 0.7,
            FaultKind::LinkReset => 2.0,
            FaultKind::Partition => 1.5,
            FaultKind::StallToElement => 1.0,
            FaultKind::StallToHost => 1.0,
            FaultKind::SlowLink => 1.5,
            FaultKind::SlowDisk => 1.0,
            FaultKind::DiskFull => 0.7,
            FaultKind::CorruptBlock => 0.7,
            FaultKind::CorruptLog => 0.5,
            // Off in the default mix, whose seeds the `bug_*` CI tests pin; swarm runs and
            // `--faults rot_newest_log_batch` inject it.
            FaultKind::RotNewestBatch => 0.0,
            FaultKind::HostSuperseded => 0.7,
            // Off in the default mix too (pinned seeds); swarm runs and `--faults` inject it.
            FaultKind::HostPause => 0.0,
            FaultKind::HostCrashStandby => 0.0,
            FaultKind::RogueElementSession => 0.0,
            FaultKind::DivergeBlock => 0.0,
            FaultKind::HostStop => 0.0,
        }
    }

    /// Injected only when asked for by name: swarm runs draw no weight for it (so the draws,
    /// and what every earlier seed means, stay as they were).
    fn opt_in(self) -> bool {
        matches!(self, FaultKind::RogueElementSession | FaultKind::DivergeBlock | FaultKind::HostStop)
    }
}

/// Faults that come from outside the system (the environment), as opposed to the
/// deliberately broken variants below, which break our own code on purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Broken {
    /// Correct code.
    None,
    /// Elements send `Applied` when a record arrives, before its fdatasync: acknowledgement
    /// before durability.
    AckBeforeSync,
    /// Elements fence nothing: records of a session an element's newer epoch superseded are
    /// committed, and so are records older than their volume's last (a `Hello` of an older
    /// epoch is still refused).
    NoFencing,
    /// A starting host element keeps the epoch its clock gave it instead of raising it above
    /// what the elements follow: one whose clock is behind is refused for good.
    ClockEpochs,
    /// Host elements answer reads without the read lease (and elements promise none): one
    /// a standby took over from serves what the new one has overwritten.
    NoReadLease,
    /// Elements check no session's role: a session holding an element's certificate may set
    /// epochs and write like a host element.
    NoRoleCheck,
    /// The host element's scrub finds replicas that differ but repairs none of them.
    NoScrubRepair,
    /// A FLUSH is answered once the writes before it are answered, not once Q elements hold
    /// them durably: with weaker ack policies it promises what nobody stored yet.
    FlushBeforeDurable,
    /// With `--volume-ops`: volumes are created without the intention log (the Slice paper's
    /// NONE): executed first, listed in the catalog after; a host element crash in between
    /// loses an acknowledged creation and leaves an orphan on the elements.
    NoIntentionLog,
    /// With `--volume-ops`: a starting host element forgets the deletions it finds pending
    /// (completes them at once, serving no placeholder): an element that was down when a
    /// volume was deleted keeps it for ever.
    ForgetDeletions,
    /// With `--volume-ops`: a starting host element undoes the resizes it finds pending
    /// instead of rolling them forward: a volume acknowledged (or already served) at its new
    /// size is served smaller again, and writes acknowledged into its new blocks are lost.
    ForgetResizes,
    /// With `--volume-ops`: a host element that takes the elements back from one that is gone
    /// (`Event::Restarted`) serves the volumes of the catalog it read before, instead of
    /// reading it again: what the other one created is lost, what it deleted is served again.
    StaleCatalog,
    /// With `--volume-ops`: a shrink is acknowledged without zeroing what lies past the new
    /// end: a later grow exposes the old data there instead of zeroes.
    ShrinkKeepsTail,
    /// With `--groups`: the host element carries each member of a consistency group as its own
    /// storage volume (its own sequence space), as if groups did not exist; the checker still
    /// holds it to the group's promise (every element's copy of the group is a prefix of one
    /// order).
    SplitGroup,
    /// With `--snapshots`: an element's snapshot preserves nothing and reads its live volume
    /// (no copy before write): a snapshot changes with every later write.
    SnapshotSharesLive,
    /// With `--snapshots --volume-ops`: an element creates a clone empty, as if it did not
    /// name its snapshot: the clone reads zeroes where it should read the snapshot.
    CloneStartsEmpty,
    /// With `--groups --volume-ops`: a volume that joins the consistency group gets a storage
    /// volume of its own (its own sequence space), as if joining did not put it in the
    /// group's one order; the checker holds it to the group's promise.
    JoinSplit,
    /// With `--groups --volume-ops`: a member that leaves the group (its deletion) keeps its
    /// data: a FLUSH stands in for the zeroing of its window.
    LeaveKeepsData,
    /// The host element sends every read to its closest element at once, however many are out
    /// there: that element's pongs queue behind its read replies, and the read lease lapses
    /// (the liveness checker sees reads fail while Q elements are in sync).
    UnboundedReads,
    /// An element that dies in the middle of a full recovery's copy forgets, once restarted,
    /// that the copy began: it reports the volume as it was before, although copied
    /// blocks overwrote a part of it, and is taken back by a quick or replay recovery.
    ForgetCopyState,
    /// A host element that becomes ready appends no beginning record and serves reads at
    /// once: a later start can roll forward a tail of an older epoch that this one's start
    /// did without (a weakly acknowledged write), after this one served reads without it.
    NoBegin,
    /// A stopping host element (`host_stop`) sends `Release` at once and goes on serving for
    /// 0.2–2 s while the next one starts: its read lease has ended at the elements, so what it
    /// reads from its cache may be what the new one has overwritten.
    ReleaseWhileServing,
    /// While no element is in sync, a volume that needs a copy is copied from any live peer,
    /// not only one the write queue streams it to: one whose copy diverged, is ahead, or is
    /// to be copied itself spreads what no quorum acknowledged, or loses what one did.
    AnyCopySource,
}

impl Broken {
    pub fn parse(s: &str) -> Option<Broken> {
        match s {
            "none" => Some(Broken::None),
            "ack-before-sync" => Some(Broken::AckBeforeSync),
            "no-fencing" => Some(Broken::NoFencing),
            "clock-epochs" => Some(Broken::ClockEpochs),
            "no-read-lease" => Some(Broken::NoReadLease),
            "no-role-check" => Some(Broken::NoRoleCheck),
            "no-scrub-repair" => Some(Broken::NoScrubRepair),
            "flush-before-durable" => Some(Broken::FlushBeforeDurable),
            "split-group" => Some(Broken::SplitGroup),
            "no-intention-log" => Some(Broken::NoIntentionLog),
            "forget-deletions" => Some(Broken::ForgetDeletions),
            "forget-resizes" => Some(Broken::ForgetResizes),
            "stale-catalog" => Some(Broken::StaleCatalog),
            "shrink-keeps-tail" => Some(Broken::ShrinkKeepsTail),
            "snapshot-shares-live" => Some(Broken::SnapshotSharesLive),
            "clone-starts-empty" => Some(Broken::CloneStartsEmpty),
            "join-split" => Some(Broken::JoinSplit),
            "leave-keeps-data" => Some(Broken::LeaveKeepsData),
            "unbounded-reads" => Some(Broken::UnboundedReads),
            "forget-copy-state" => Some(Broken::ForgetCopyState),
            "no-begin" => Some(Broken::NoBegin),
            "release-while-serving" => Some(Broken::ReleaseWhileServing),
            "any-copy-source" => Some(Broken::AnyCopySource),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Broken::None => "none",
            Broken::AckBeforeSync => "ack-before-sync",
            Broken::NoFencing => "no-fencing",
            Broken::ClockEpochs => "clock-epochs",
            Broken::NoReadLease => "no-read-lease",
            Broken::NoRoleCheck => "no-role-check",
            Broken::NoScrubRepair => "no-scrub-repair",
            Broken::FlushBeforeDurable => "flush-before-durable",
            Broken::SplitGroup => "split-group",
            Broken::NoIntentionLog => "no-intention-log",
            Broken::ForgetDeletions => "forget-deletions",
            Broken::ForgetResizes => "forget-resizes",
            Broken::StaleCatalog => "stale-catalog",
            Broken::ShrinkKeepsTail => "shrink-keeps-tail",
            Broken::SnapshotSharesLive => "snapshot-shares-live",
            Broken::CloneStartsEmpty => "clone-starts-empty",
            Broken::JoinSplit => "join-split",
            Broken::LeaveKeepsData => "leave-keeps-data",
            Broken::UnboundedReads => "unbounded-reads",
            Broken::ForgetCopyState => "forget-copy-state",
            Broken::NoBegin => "no-begin",
            Broken::ReleaseWhileServing => "release-while-serving",
            Broken::AnyCopySource => "any-copy-source",
        }
    }
}

#[derive(Clone, Debug)]
pub struct SimOptions {
    pub seed: u64,
    pub elements: usize,
    pub quorum: usize,
    /// Draw the fault mix and rates from the seed (some kinds off, others frequent).
    pub swarm: bool,
    /// Simulated length of the phase with workload and faults.
    pub fault_phase_ms: u64,
    /// Mean time between faults in the fault phase (swarm runs draw their own).
    pub fault_interval_ms: f64,
    pub broken: Broken,
    /// Inject only these kinds of fault (each at its usual weight; swarm runs draw theirs).
    /// Empty: every kind.
    pub only_faults: Vec<FaultKind>,
    /// Ack policy per element (`--ack durable,received,network-sync`); empty: all durable.
    pub ack: Vec<starfish_core::AckPolicy>,
    /// Consistency groups: vol0 and vol1 (of 2 or 3 volumes) form group `g`, carried as one
    /// storage volume and exported as windows of it, as the host element's shell does.
    pub groups: bool,
    /// Volumes are created while running (`starfish volume create`: the real catalog and
    /// intention log over the catalog's storage volume), among the faults.
    pub volume_ops: bool,
    /// Hosts take snapshots of the configured volumes (records in their ordered streams),
    /// read them and delete them, among the faults.
    pub snapshots: bool,
    /// Print every event to stderr.
    pub trace: bool,
}

impl SimOptions {
    pub fn new(seed: u64, elements: usize, quorum: usize) -> SimOptions {
        SimOptions {
            seed,
            elements,
            quorum,
            swarm: false,
            fault_phase_ms: 20_000,
            fault_interval_ms: 1_000.0,
            broken: Broken::None,
            only_faults: Vec::new(),
            ack: Vec::new(),
            groups: false,
            volume_ops: false,
            snapshots: false,
            trace: false,
        }
    }

    /// The command that replays this run exactly.
    pub fn replay_command(&self) -> String {
        let mut cmd = format!(
            "cargo run --release -p sim -- --seed {} --elements {} --quorum {}",
            self.seed, self.elements, self.quorum
        );
        if self.swarm {
            cmd.push_str(" --swarm");
        }
        if self.fault_phase_ms != SimOptions::new(0, 1, 1).fault_phase_ms {
            cmd.push_str(&format!(" --fault-phase-ms {}", self.fault_phase_ms));
        }
        if self.fault_interval_ms != SimOptions::new(0, 1, 1).fault_interval_ms {
            cmd.push_str(&format!(" --fault-interval-ms {}", self.fault_interval_ms));
        }
        if self.broken != Broken::None {
            cmd.push_str(&format!(" --broken {}", self.broken.name()));
        }
        if !self.only_faults.is_empty() {
            let names: Vec<&str> = self.only_faults.iter().map(|k| k.name()).collect();
            cmd.push_str(&format!(" --faults {}", names.join(",")));
        }
        if !self.ack.is_empty() {
            let names: Vec<&str> = self.ack.iter().map(|p| p.as_str()).collect();
            cmd.push_str(&format!(" --ack {}", names.join(",")));
        }
        if self.groups {
            cmd.push_str(" --groups");
        }
        if self.volume_ops {
            cmd.push_str(" --volume-ops");
        }
        if self.snapshots {
            cmd.push_str(" --snapshots");
        }
        cmd.push_str(" --trace");
        cmd
    }
}

/// One-way latency and jitter of a link, in microseconds.
#[derive(Clone, Copy, Debug)]
pub struct LinkProfile {
    pub latency_us: u64,
    pub jitter_us: u64,
    /// Bytes per second (0: unlimited).
    pub bandwidth_bytes_per_s: u64,
}

/// Everything the seed decides before the run starts.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub volumes: usize,
    pub volume_bytes: u64,
    pub links: Vec<LinkProfile>,
    pub fsync_us: Vec<u64>,
    pub replay_log_bytes: Vec<u64>,
    pub write_queue_bytes: u64,
    pub read_cache_bytes: u64,
    pub heartbeat_interval_ms: u64,
    pub heartbeat_timeout_ms: u64,
    pub throttle_timeout_ms: u64,
    pub startup_grace_ms: u64,
    /// Let the host element use replay recovery (elements pull from a peer's replay log).
    pub replay_recovery: bool,
    pub clients: usize,
    /// Share of big writes (128 KiB – 1 MiB), which fill the write queue.
    pub big_write_share: f64,
    pub fault_weights: Vec<f64>,
    pub fault_interval_ms: f64,
    /// The host element scrubs every volume this often (0: not within a run): every second
    /// in runs that inject silent divergence.
    pub scrub_interval_ms: u64,
}

impl Scenario {
    pub fn draw(options: &SimOptions, rng: &mut Rng) -> Scenario {
        let n = options.elements;
        // Elements by site: the first local, the second near, the rest far.
        let links = (0..n)
            .map(|i| {
                let (lo, hi) = match i {
                    0 => (20, 150),
                    1 => (300, 2_000),
                    _ => (4_000, 30_000),
                };
                let latency_us = rng.range(lo, hi);
                LinkProfile {
                    latency_us,
                    jitter_us: latency_us / 10 + 1,
                    bandwidth_bytes_per_s: *[0u64, 0, 12_500_000, 125_000_000]
                        .get(rng.below(4) as usize)
                        .expect("index below 4"),
                }
            })
            .collect();
        let fsync_us = (0..n).map(|_| rng.range(100, 4_000)).collect();
        let replay_log_bytes =
            (0..n).map(|_| *[256u64 << 10, 4 << 20, 64 << 20].get(rng.below(3) as usize).expect("3")).collect();
        let write_queue_bytes = starfish_core::limits::WRITE_QUEUE_BYTES_MIN + rng.below(3) * (8 << 20);
        let read_cache_bytes = *[0u64, 16 << 10, 256 << 10, 8 << 20].get(rng.below(4) as usize).expect("4");
        let heartbeat_interval_ms = rng.range(100, 500);
        let heartbeat_timeout_ms = heartbeat_interval_ms * rng.range(3, 6);
        let mut fault_weights: Vec<f64> = FaultKind::ALL.iter().map(|k| k.default_weight()).collect();
        let mut fault_interval_ms = options.fault_interval_ms;
        if options.swarm {
            // Swarm testing: each run has its own mix, with some kinds switched off entirely.
            for (w, kind) in fault_weights.iter_mut().zip(FaultKind::ALL) {
                if !kind.opt_in() {
                    *w = if rng.chance(0.3) { 0.0 } else { rng.f64() * 4.0 };
                }
            }
            if fault_weights.iter().all(|w| *w == 0.0) {
                fault_weights[0] = 1.0;
            }
            fault_interval_ms = 50.0 + rng.f64() * 1_500.0;
        }
        if !options.only_faults.is_empty() {
            for (w, kind) in fault_weights.iter_mut().zip(FaultKind::ALL) {
                if !options.only_faults.contains(&kind) {
                    *w = 0.0;
                } else if (!options.swarm || kind.opt_in()) && *w == 0.0 {
                    // Asked for by name although off in the default mix.
                    *w = 1.0;
                }
            }
            if fault_weights.iter().all(|w| *w == 0.0) {
                // A swarm run drew zero for every kind asked for.
                let first = FaultKind::ALL.iter().position(|k| options.only_faults.contains(k));
                fault_weights[first.expect("non-empty")] = 1.0;
            }
        }
        let diverging =
            fault_weights[FaultKind::ALL.iter().position(|k| *k == FaultKind::DivergeBlock).expect("listed")] > 0.0;
        Scenario {
            scrub_interval_ms: if diverging { 1_000 } else { 0 },
            // Groups need two volumes at least; their draw comes from a stream of its own so
            // that every other draw of a seed stays as it was.
            volumes: match rng.range(1, 2) as usize {
                _ if options.groups => Rng::new(options.seed, 8).range(2, 3) as usize,
                drawn => drawn,
            },
            volume_bytes: *[512u64 << 10, 2 << 20].get(rng.below(2) as usize).expect("2"),
            links,
            fsync_us,
            replay_log_bytes,
            write_queue_bytes,
            read_cache_bytes,
            heartbeat_interval_ms,
            heartbeat_timeout_ms,
            throttle_timeout_ms: rng.range(300, 2_000),
            startup_grace_ms: rng.range(500, 3_000),
            replay_recovery: rng.chance(0.5),
            clients: rng.range(2, 6) as usize,
            big_write_share: *[0.0, 0.02, 0.08].get(rng.below(3) as usize).expect("3"),
            fault_weights,
            fault_interval_ms,
        }
    }
}
