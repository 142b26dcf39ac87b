//! `cargo run --release -p sim -- --seeds K [--elements N --quorum Q] [--seed S] [--json]`
//!
//! Runs seeded simulations and prints runs, faults injected, violations and the replay command
//! of each failure. Exit status 1 when any run breached the contract.
//!
//! `sim check-history FILE [--data PATH] [--json]` judges a history recorded against real
//! processes with the same model (see [`sim::history`]): exit status 1 on a violation, 2 when
//! the history cannot be read.

use std::process::ExitCode;

use sim::{Broken, SimOptions, Summary};

const USAGE: &str = "usage: sim [--seeds K] [--seed S] [--elements N] [--quorum Q] [--swarm] [--json]
           [--fault-phase-ms MS] [--fault-interval-ms MS] [--faults KIND,…]
           [--broken none|ack-before-sync|no-fencing|clock-epochs|no-read-lease|no-role-check|no-scrub-repair|flush-before-durable|split-group|no-intention-log|forget-deletions|forget-resizes|stale-catalog|shrink-keeps-tail|snapshot-shares-live|clone-starts-empty|join-split|leave-keeps-data|unbounded-reads|forget-copy-state|no-begin|release-while-serving|any-copy-source]
           [--groups] [--volume-ops] [--snapshots] [--ack POLICY,… (one per element: durable, received, remote-sync, network-sync, local-sync)] [--threads T] [--trace]

  --seeds K       run K seeds, starting at --seed (default 0); without --seeds, run --seed alone
  --swarm         draw the fault mix and rates from each seed (swarm testing)
  --faults K,…    inject only these kinds of fault (names as in the report, e.g. host_superseded)
  --broken X      run a deliberately broken variant, to show the checkers catch it
  --groups        vol0 and vol1 form a consistency group (one storage volume, one order)
  --volume-ops    create volumes while running, through the catalog's intention log (Q > N/2)
  --snapshots     take, read and delete snapshots of the configured volumes among the faults
  --trace         print every event (for replaying one seed)

       sim check-history FILE [--data PATH] [--json]

  judge a history recorded against real processes (tests/test_fault_history.py) with the
  simulator's checkers; the reads' data are in PATH (default FILE.data)";

fn check_history(args: impl Iterator<Item = String>) -> ExitCode {
    let mut file = None;
    let mut data_path = None;
    let mut json = false;
    let mut args = args.peekable();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--json" => json = true,
            "--data" => match args.next() {
                Some(p) => data_path = Some(p),
                None => {
                    eprintln!("sim check-history: --data needs a value\n{USAGE}");
                    return ExitCode::from(2);
                }
            },
            other if file.is_none() && !other.starts_with("--") => file = Some(other.to_string()),
            other => {
                eprintln!("sim check-history: unexpected argument {other}\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    let Some(file) = file else {
        eprintln!("sim check-history: which history file?\n{USAGE}");
        return ExitCode::from(2);
    };
    let data_path = data_path.unwrap_or_else(|| format!("{file}.data"));
    let text = match std::fs::read_to_string(&file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("sim check-history: {file}: {e}");
            return ExitCode::from(2);
        }
    };
    let data = match std::fs::read(&data_path) {
        Ok(d) => d,
        // A history without successful reads needs no data file.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => {
            eprintln!("sim check-history: {data_path}: {e}");
            return ExitCode::from(2);
        }
    };
    let started = std::time::Instant::now();
    let report = match sim::history::History::parse(&text).and_then(|h| sim::history::check(&h, &data)) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("sim check-history: {file}: {e}");
            return ExitCode::from(2);
        }
    };
    if json {
        println!("{}", report.json());
    } else {
        println!("history {file}: checked in {:.2} s", started.elapsed().as_secs_f64());
        print!("{}", report.text());
    }
    if report.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().map(String::as_str) == Some("check-history") {
        args.next();
        return check_history(args);
    }
    let mut options = SimOptions::new(0, 3, 2);
    let mut seeds: Option<u64> = None;
    let mut json = false;
    let mut threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut quorum_given = false;
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> Result<String, String> { args.next().ok_or(format!("{name} needs a value")) };
        let parsed: Result<(), String> = (|| {
            match arg.as_str() {
                "--seeds" => seeds = Some(value("--seeds")?.parse().map_err(|e| format!("--seeds: {e}"))?),
                "--seed" => options.seed = value("--seed")?.parse().map_err(|e| format!("--seed: {e}"))?,
                "--elements" => {
                    options.elements = value("--elements")?.parse().map_err(|e| format!("--elements: {e}"))?
                }
                "--quorum" => {
                    options.quorum = value("--quorum")?.parse().map_err(|e| format!("--quorum: {e}"))?;
                    quorum_given = true;
                }
                "--fault-phase-ms" => {
                    options.fault_phase_ms =
                        value("--fault-phase-ms")?.parse().map_err(|e| format!("--fault-phase-ms: {e}"))?
                }
                "--fault-interval-ms" => {
                    options.fault_interval_ms =
                        value("--fault-interval-ms")?.parse().map_err(|e| format!("--fault-interval-ms: {e}"))?
                }
                "--faults" => {
                    for name in value("--faults")?.split(',') {
                        options
                            .only_faults
                            .push(sim::FaultKind::parse(name).ok_or(format!("--faults: unknown kind {name}"))?);
                    }
                }
                "--ack" => {
                    for name in value("--ack")?.split(',') {
                        options.ack.push(starfish_core::AckPolicy::parse(name).map_err(|e| format!("--ack: {e}"))?);
                    }
                }
                "--broken" => {
                    let v = value("--broken")?;
                    options.broken = Broken::parse(&v).ok_or(format!("--broken: unknown variant {v}"))?;
                }
                "--threads" => threads = value("--threads")?.parse().map_err(|e| format!("--threads: {e}"))?,
                "--swarm" => options.swarm = true,
                "--groups" => options.groups = true,
                "--volume-ops" => options.volume_ops = true,
                "--snapshots" => options.snapshots = true,
                "--json" => json = true,
                "--trace" => options.trace = true,
                "-h" | "--help" => return Err(String::new()),
                other => return Err(format!("unknown argument {other}")),
            }
            Ok(())
        })();
        if let Err(message) = parsed {
            if !message.is_empty() {
                eprintln!("sim: {message}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    }
    if !quorum_given {
        options.quorum = options.elements / 2 + 1;
    }
    if options.elements == 0
        || options.elements > starfish_core::limits::ELEMENTS_MAX
        || options.quorum == 0
        || options.quorum > options.elements
    {
        eprintln!("sim: need 1 ≤ Q ≤ N ≤ {}", starfish_core::limits::ELEMENTS_MAX);
        return ExitCode::from(2);
    }
    if !options.ack.is_empty()
        && (options.ack.len() != options.elements
            || options.ack.iter().filter(|p| p.counts_toward_quorum()).count() < options.quorum)
    {
        eprintln!("sim: --ack needs one policy per element, and at least Q that are not local-sync");
        return ExitCode::from(2);
    }
    if options.broken == Broken::SplitGroup && !options.groups {
        eprintln!("sim: --broken split-group needs --groups");
        return ExitCode::from(2);
    }
    if options.volume_ops && 2 * options.quorum <= options.elements {
        eprintln!("sim: --volume-ops needs Q > N/2 (with less, acknowledged writes may be lost, the catalog's too)");
        return ExitCode::from(2);
    }
    if matches!(
        options.broken,
        Broken::ForgetDeletions | Broken::ForgetResizes | Broken::StaleCatalog | Broken::ShrinkKeepsTail
    ) && !options.volume_ops
    {
        eprintln!("sim: --broken {} needs --volume-ops", options.broken.name());
        std::process::exit(2);
    }
    if options.broken == Broken::SnapshotSharesLive && !options.snapshots {
        eprintln!("sim: --broken snapshot-shares-live needs --snapshots");
        return ExitCode::from(2);
    }
    if options.broken == Broken::CloneStartsEmpty && !(options.snapshots && options.volume_ops && !options.groups) {
        eprintln!("sim: --broken clone-starts-empty needs --snapshots --volume-ops (without --groups)");
        std::process::exit(2);
    }
    if matches!(options.broken, Broken::JoinSplit | Broken::LeaveKeepsData) && !(options.groups && options.volume_ops) {
        eprintln!("sim: --broken {} needs --groups --volume-ops", options.broken.name());
        return ExitCode::from(2);
    }
    if options.broken == Broken::NoIntentionLog && !options.volume_ops {
        eprintln!("sim: --broken no-intention-log needs --volume-ops");
        return ExitCode::from(2);
    }
    let count = seeds.unwrap_or(1);
    if options.trace {
        threads = 1;
    }
    let started = std::time::Instant::now();
    let reports = sim::run_many(&options, options.seed, count, threads);
    let mut summary = Summary::default();
    for r in &reports {
        summary.add(r);
    }
    if json {
        println!("{}", summary.json());
    } else {
        println!(
            "N={} Q={} seeds {}..{}{}{}{} in {:.1} s",
            options.elements,
            options.quorum,
            options.seed,
            options.seed + count - 1,
            if options.swarm { " (swarm)" } else { "" },
            if options.groups { " (groups)" } else { "" },
            if options.broken != Broken::None {
                format!(" BROKEN VARIANT {}", options.broken.name())
            } else {
                String::new()
            },
            started.elapsed().as_secs_f64()
        );
        print!("{}", summary.text());
        if count == 1 {
            let r = &reports[0];
            for v in &r.violations {
                println!("  violation: {v}");
            }
            for n in &r.notes {
                println!("  note: {n}");
            }
            println!(
                "  digest {:016x}, {} events, longest past-deadline stretch {} ms",
                r.digest, r.events, r.past_deadline_ms_max
            );
        }
    }
    if summary.violations > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
