//! Table 7: PostMark on ext4 over the volume — nbdfuse exposes the export as a file, a loop
//! device (direct I/O) makes it a block device, ext4 is mounted with `-o sync` so every write
//! reaches the volume before the system call returns — for N=2 and N=3, Q=1 and Q=2, with the
//! same-run baselines. Only PostMark's transaction phase is timed, as in the paper.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::cluster::{Cluster, ClusterSpec, Site};
use super::process::{require_tools, run_bounded, Child, STOP_GRACE};
use super::{cell, new_row, number, set_number, text_table, Bench, Mode, Row};

const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// PostMark's parameters: the paper's Table 4 is 40,904 files and 204,520 transactions of
/// 500–10,000 bytes; we keep the ratio (1:5) and the sizes and scale the counts down.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scale {
    pub files: u64,
    pub transactions: u64,
    pub volume_bytes: u64,
    pub timeout_s: u64,
}

pub fn scale(mode: Mode) -> Scale {
    match mode {
        Mode::Quick => Scale { files: 20, transactions: 100, volume_bytes: 256 << 20, timeout_s: 40 },
        Mode::Default => Scale { files: 500, transactions: 2500, volume_bytes: 1 << 30, timeout_s: 600 },
        Mode::Full => Scale { files: 2000, transactions: 10_000, volume_bytes: 1 << 30, timeout_s: 1800 },
    }
}

pub fn postmark_config(location: &Path, scale: &Scale) -> String {
    format!(
        "set location {}\nset number {}\nset transactions {}\nset size 500 10000\nset subdirectories 10\n\
         set read 4096\nset write 4096\nset seed 42\nrun\nquit\n",
        location.display(),
        scale.files,
        scale.transactions
    )
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Config {
    pub elements: usize,
    pub quorum: usize,
    pub near_ms: f64,
    pub far_ms: f64,
    pub far_rate_mbit: Option<f64>,
}

impl Config {
    fn kind(&self) -> &'static str {
        if self.far_rate_mbit.is_some() {
            "internet"
        } else {
            "dark_fiber"
        }
    }

    fn sites(&self) -> Vec<Site> {
        let mut sites = vec![Site::new("local", 0.0, None), Site::new("near", self.near_ms, None)];
        if self.elements == 3 {
            sites.push(Site::new("far", self.far_ms, self.far_rate_mbit));
        }
        sites
    }
}

/// Near 1 ms everywhere; N=3's far site is the paper's worst Internet link (65 ms, 51 Mb/s).
pub fn grid(mode: Mode) -> Vec<Config> {
    let n2 = |quorum| Config { elements: 2, quorum, near_ms: 1.0, far_ms: 0.0, far_rate_mbit: None };
    let n3 = |quorum, near_ms, far_ms, rate| Config { elements: 3, quorum, near_ms, far_ms, far_rate_mbit: rate };
    match mode {
        Mode::Quick => vec![n3(2, 1.0, 65.0, Some(51.0))],
        Mode::Default => vec![n2(1), n2(2), n3(1, 1.0, 65.0, Some(51.0)), n3(2, 1.0, 65.0, Some(51.0))],
        Mode::Full => vec![
            n2(1),
            n2(2),
            n3(1, 1.0, 8.0, None),
            n3(2, 1.0, 8.0, None),
            n3(2, 4.0, 8.0, None),
            n3(1, 1.0, 23.0, Some(124.0)),
            n3(2, 1.0, 23.0, Some(124.0)),
            n3(1, 1.0, 65.0, Some(51.0)),
            n3(2, 1.0, 65.0, Some(51.0)),
        ],
    }
}

fn mounted(path: &Path) -> bool {
    let Ok(path) = std::fs::canonicalize(path) else { return false };
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else { return false };
    mounts.lines().any(|line| line.split_whitespace().nth(1).map(Path::new) == Some(path.as_path()))
}

/// nbdfuse + loop device + ext4, torn down in reverse on every path (also on errors: Drop).
struct Ext4Stack {
    scratch: PathBuf,
    fuse_dir: PathBuf,
    mountpoint: PathBuf,
    nbdfuse: Option<Child>,
    loop_device: Option<String>,
}

impl Ext4Stack {
    fn mount(uri: &str, scratch: &Path) -> Result<Ext4Stack> {
        let fuse_dir = scratch.join("fuse");
        let mountpoint = scratch.join("fs");
        std::fs::create_dir_all(&fuse_dir).context("creating the FUSE mount point")?;
        std::fs::create_dir_all(&mountpoint).context("creating the ext4 mount point")?;
        let mut stack = Ext4Stack {
            scratch: scratch.to_path_buf(),
            fuse_dir: fuse_dir.clone(),
            mountpoint: mountpoint.clone(),
            nbdfuse: None,
            loop_device: None,
        };
        let disk = fuse_dir.join("disk");
        let pidfile = scratch.join("nbdfuse.pid");
        let mut cmd = Command::new("nbdfuse");
        cmd.arg("-P").arg(&pidfile).arg(&disk).arg(uri);
        let mut nbdfuse = Child::spawn("nbdfuse", &mut cmd, &scratch.join("nbdfuse.log"))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while !pidfile.exists() {
            nbdfuse.check_alive()?;
            if Instant::now() > deadline {
                bail!("nbdfuse was not ready within 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        stack.nbdfuse = Some(nbdfuse);
        let out = run_bounded(
            "losetup",
            Command::new("losetup").arg("--direct-io=on").arg("-f").arg("--show").arg(&disk),
            STEP_TIMEOUT,
            scratch,
        )?;
        let device = out.stdout.trim().to_string();
        if !device.starts_with("/dev/loop") {
            bail!("losetup printed {device:?}, not a loop device");
        }
        stack.loop_device = Some(device.clone());
        // Everything initialised now, so no lazy-init thread writes during the measurement.
        run_bounded(
            "mkfs.ext4",
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0"])
                .arg(&device),
            Duration::from_secs(300),
            scratch,
        )?;
        run_bounded(
            "mount",
            Command::new("mount").args(["-t", "ext4", "-o", "sync"]).arg(&device).arg(&mountpoint),
            STEP_TIMEOUT,
            scratch,
        )?;
        Ok(stack)
    }

    fn teardown(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        let scratch = self.scratch.clone();
        let run = |what: &str, cmd: &mut Command| run_bounded(what, cmd, STEP_TIMEOUT, &scratch).is_ok();
        if mounted(&self.mountpoint) && !run("umount", Command::new("umount").arg(&self.mountpoint)) {
            problems.push("umount failed; lazy unmount".to_string());
            run("umount -l", Command::new("umount").arg("-l").arg(&self.mountpoint));
        }
        if let Some(device) = self.loop_device.take() {
            if !run("losetup -d", Command::new("losetup").arg("-d").arg(&device)) {
                problems.push(format!("losetup -d {device} failed"));
            }
        }
        if mounted(&self.fuse_dir) && !run("fusermount3 -u", Command::new("fusermount3").arg("-u").arg(&self.fuse_dir))
        {
            problems.push("fusermount3 -u failed; lazy unmount".to_string());
            run("fusermount3 -uz", Command::new("fusermount3").arg("-uz").arg(&self.fuse_dir));
        }
        if let Some(mut nbdfuse) = self.nbdfuse.take() {
            if nbdfuse.stop(STOP_GRACE) {
                problems.push("nbdfuse had to be killed".to_string());
            }
        }
        problems
    }
}

impl Drop for Ext4Stack {
    fn drop(&mut self) {
        for problem in self.teardown() {
            eprintln!("bench: cleaning up ext4 on NBD: {problem}");
        }
    }
}

/// What one PostMark run measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PostMark {
    /// Transactions per second over the transaction phase, timed here to the millisecond.
    pub tps: f64,
    /// PostMark's own figure (whole seconds, so coarse), for cross-checking.
    pub reported_tps: Option<f64>,
    /// Volume writes the host element acknowledged during the transaction phase, per
    /// transaction: how many synchronous round trips a transaction costs.
    pub writes_per_transaction: Option<f64>,
}

/// PostMark's "N seconds of transactions (M per second)".
pub fn reported_tps(stdout: &str) -> Option<f64> {
    let at = stdout.find("seconds of transactions (")?;
    let rest = &stdout[at + "seconds of transactions (".len()..];
    rest.split_whitespace().next()?.parse().ok()
}

/// Runs PostMark with unbuffered stdout and times its phase markers as they arrive: from
/// "Performing transactions" to the "Done" that ends it.
fn postmark(
    config_path: &Path,
    transactions: u64,
    timeout: Duration,
    scratch: &Path,
    acked_writes: &dyn Fn() -> Option<u64>,
) -> Result<PostMark> {
    let mut cmd = Command::new("stdbuf");
    cmd.arg("-o0").arg("postmark").arg(config_path).current_dir(scratch);
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null());
    let mut child = Child::spawn_piped("postmark", &mut cmd)?;
    let mut stdout = child.take_stdout().context("postmark's stdout")?;
    let (sender, receiver) = mpsc::channel::<(Instant, u8)>();
    let reader = std::thread::spawn(move || {
        let mut byte = [0u8; 1];
        while let Ok(1) = stdout.read(&mut byte) {
            if sender.send((Instant::now(), byte[0])).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + timeout;
    let mut text = String::new();
    let (mut started, mut finished) = (None, None);
    let (mut writes_start, mut writes_end) = (None, None);
    loop {
        match receiver.recv_timeout(Duration::from_millis(100)) {
            Ok((at, byte)) => {
                text.push(byte as char);
                if started.is_none() && text.ends_with("Performing transactions") {
                    started = Some((at, text.len()));
                    writes_start = acked_writes();
                }
                if let (Some((_, from)), None) = (started, finished) {
                    if text[from..].ends_with("Done") {
                        finished = Some(at);
                        writes_end = acked_writes();
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if Instant::now() > deadline {
            child.stop(Duration::from_secs(1));
            bail!("postmark did not finish within {} s (scale it down with --quick)", timeout.as_secs());
        }
    }
    let _ = reader.join();
    let status = child.wait_bounded(Duration::from_secs(10))?;
    if !status.success() {
        bail!("postmark failed ({status}); it printed:\n{text}");
    }
    let (Some((start, _)), Some(end)) = (started, finished) else {
        bail!("postmark's output lacks its transaction phase:\n{text}");
    };
    let seconds = end.duration_since(start).as_secs_f64();
    if seconds <= 0.0 {
        bail!("postmark's transaction phase took no time");
    }
    let writes_per_transaction = match (writes_start, writes_end) {
        (Some(a), Some(b)) if b >= a => Some((b - a) as f64 / transactions as f64),
        _ => None,
    };
    Ok(PostMark { tps: transactions as f64 / seconds, reported_tps: reported_tps(&text), writes_per_transaction })
}

fn measure(bench: &Bench, sites: Vec<Site>, quorum: usize, label: &str) -> Result<PostMark> {
    let s = scale(bench.mode);
    let spec = ClusterSpec {
        sites,
        quorum,
        volume_bytes: s.volume_bytes,
        read_cache_bytes: None,
        tls: false,
        host_extra: Vec::new(),
    };
    let mut cluster = Cluster::start(&bench.bin, &bench.work, &spec)?;
    let scratch = cluster.scratch().to_path_buf();
    let result = {
        let stack = Ext4Stack::mount(&cluster.uri(), &scratch)?;
        let config_path = scratch.join("postmark.cfg");
        std::fs::write(&config_path, postmark_config(&stack.mountpoint, &s))
            .context("writing PostMark's configuration")?;
        let acked_writes = || cluster.acked_writes().ok();
        let result = postmark(&config_path, s.transactions, Duration::from_secs(s.timeout_s), &scratch, &acked_writes);
        drop(stack);
        result?
    };
    cluster.check_alive()?;
    bench.progress(&format!(
        "t7 {label}: {:.1} transactions/s (PostMark's own whole-second figure: {}), {} volume writes per transaction",
        result.tps,
        result.reported_tps.map_or("-".into(), |t| t.to_string()),
        result.writes_per_transaction.map_or("-".into(), |w| format!("{w:.1}"))
    ));
    Ok(result)
}

pub fn run(bench: &Bench) -> Result<Vec<Row>> {
    require_tools(&[
        ("postmark", "postmark"),
        ("nbdfuse", "nbdfuse (Debian: libnbd-bin)"),
        ("fusermount3", "fuse3"),
        ("losetup", "mount"),
        ("mount", "mount"),
        ("umount", "mount"),
        ("mkfs.ext4", "e2fsprogs"),
        ("stdbuf", "coreutils"),
    ])?;
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("Table 7 needs root (loop devices and mount)");
    }
    if !Path::new("/dev/fuse").exists() {
        bail!("Table 7 needs /dev/fuse (nbdfuse)");
    }
    let configs = grid(bench.mode);
    let direct_sites = || vec![Site::new("local", 0.0, None)];
    let direct_first = measure(bench, direct_sites(), 1, "direct-attached (first)")?;
    let mut near_delays: Vec<f64> = configs.iter().map(|c| c.near_ms).collect();
    near_delays.sort_by(f64::total_cmp);
    near_delays.dedup();
    let mut near_disk = Vec::new();
    for near_ms in near_delays {
        let label = format!("one disk at the near site, {near_ms} ms");
        near_disk.push((near_ms, measure(bench, vec![Site::new("near", near_ms, None)], 1, &label)?));
    }
    let mut measured = Vec::new();
    for config in &configs {
        let far = if config.elements == 3 {
            format!(" far {} ms{}", config.far_ms, config.far_rate_mbit.map_or(String::new(), |r| format!(" {r} Mb/s")))
        } else {
            String::new()
        };
        let label = format!("N={} Q={} near {} ms{far}", config.elements, config.quorum, config.near_ms);
        measured.push(measure(bench, config.sites(), config.quorum, &label)?);
    }
    // The machine's load drifts during a run of minutes: the baseline is measured first and
    // last, and the rows compare against the mean of the two.
    let direct_last = measure(bench, direct_sites(), 1, "direct-attached (last)")?;
    let direct_tps = (direct_first.tps + direct_last.tps) / 2.0;
    let mut rows = Vec::new();
    let mut row = new_row("t7", "direct");
    row.insert("elements".into(), Value::from(1));
    row.insert("quorum".into(), Value::from(1));
    set_number(&mut row, "postmark_tps", direct_tps);
    set_number(&mut row, "postmark_tps_first", direct_first.tps);
    set_number(&mut row, "postmark_tps_last", direct_last.tps);
    set_writes(&mut row, &direct_first);
    rows.push(row);
    for (near_ms, figures) in &near_disk {
        let mut row = new_row("t7", "near_disk");
        row.insert("elements".into(), Value::from(1));
        row.insert("quorum".into(), Value::from(1));
        set_number(&mut row, "near_delay_ms", *near_ms);
        set_number(&mut row, "postmark_tps", figures.tps);
        set_number(&mut row, "direct_postmark_tps", direct_tps);
        set_writes(&mut row, figures);
        rows.push(row);
    }
    for (config, figures) in configs.iter().zip(&measured) {
        let near = near_disk.iter().find(|(d, _)| *d == config.near_ms).map(|(_, f)| f.tps);
        let mut row = config_row(config, figures.tps, direct_tps, near);
        set_writes(&mut row, figures);
        rows.push(row);
    }
    Ok(rows)
}

fn set_writes(row: &mut Row, figures: &PostMark) {
    if let Some(writes) = figures.writes_per_transaction {
        set_number(row, "volume_writes_per_transaction", writes);
    }
}

pub fn config_row(config: &Config, tps: f64, direct_tps: f64, near_disk_tps: Option<f64>) -> Row {
    let mut row = new_row("t7", config.kind());
    row.insert("elements".into(), Value::from(config.elements));
    row.insert("quorum".into(), Value::from(config.quorum));
    set_number(&mut row, "near_delay_ms", config.near_ms);
    if config.elements == 3 {
        set_number(&mut row, "far_delay_ms", config.far_ms);
        if let Some(rate) = config.far_rate_mbit {
            set_number(&mut row, "far_rate_mbit", rate);
        }
    }
    set_number(&mut row, "postmark_tps", tps);
    set_number(&mut row, "direct_postmark_tps", direct_tps);
    set_number(&mut row, "fraction_of_direct", tps / direct_tps);
    if let Some(near) = near_disk_tps {
        set_number(&mut row, "near_disk_postmark_tps", near);
        set_number(&mut row, "fraction_of_near_disk", tps / near);
    }
    row
}

pub fn text(rows: &[Row]) -> String {
    let mut lines = Vec::new();
    for row in rows {
        let config = row["config"].as_str().unwrap_or("?");
        let name = match config {
            "direct" => "direct-attached (N=1)".to_string(),
            "near_disk" => "one disk at near site (N=1)".to_string(),
            "internet" => format!("Internet N={}", cell(row, "elements", 0)),
            _ => format!("dark fiber N={}", cell(row, "elements", 0)),
        };
        let far = match (number(row, "far_delay_ms"), number(row, "far_rate_mbit")) {
            (Some(d), Some(r)) => format!("{d}/{r}"),
            (Some(d), None) => format!("{d}"),
            _ => "-".to_string(),
        };
        let percent = |key: &str| number(row, key).map_or("-".to_string(), |f| format!("{:.0} %", 100.0 * f));
        let quorum = if config == "direct" || config == "near_disk" { "-".to_string() } else { cell(row, "quorum", 0) };
        lines.push(vec![
            name,
            quorum,
            cell(row, "near_delay_ms", 0),
            far,
            cell(row, "postmark_tps", 1),
            percent("fraction_of_direct"),
            percent("fraction_of_near_disk"),
            cell(row, "volume_writes_per_transaction", 1),
        ]);
    }
    text_table(
        "Table 7: PostMark transactions/s on ext4 (mounted -o sync) over nbdfuse + loop; local element 0 ms",
        &["configuration", "Q", "near ms", "far ms/Mb/s", "tps", "of direct", "of near disk", "writes/txn"],
        &lines,
        &["(the paper: RAID 73.1 tps; N=3 Q=2 near 1 ms, far 65 ms / 51 Mb/s: 62.5 tps = 85 % of RAID)".to_string()],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postmark_output_and_config() {
        let out = "Time:\n\t12 seconds total\n\t10 seconds of transactions (250 per second)\n";
        assert_eq!(reported_tps(out), Some(250.0));
        assert_eq!(reported_tps("nothing"), None);
        let config = postmark_config(Path::new("/mnt/x"), &scale(Mode::Default));
        assert!(config.starts_with("set location /mnt/x\nset number 500\nset transactions 2500\n"));
        assert!(config.ends_with("run\nquit\n"));
        let s = scale(Mode::Full);
        assert_eq!(s.transactions, 5 * s.files, "the paper's ratio of transactions to files");
    }

    #[test]
    fn rows_hold_fractions_of_both_baselines() {
        let config = Config { elements: 3, quorum: 2, near_ms: 1.0, far_ms: 65.0, far_rate_mbit: Some(51.0) };
        let row = config_row(&config, 80.0, 100.0, Some(85.0));
        assert_eq!(row["config"], "internet");
        assert_eq!(number(&row, "fraction_of_direct"), Some(0.8));
        assert_eq!(number(&row, "fraction_of_near_disk"), Some(0.9412));
        assert_eq!(number(&row, "far_rate_mbit"), Some(51.0));
        let n2 = config_row(&Config { elements: 2, far_rate_mbit: None, ..config }, 90.0, 100.0, None);
        assert!(n2.get("far_delay_ms").is_none());
        assert!(text(&[row, n2]).contains("Internet N=3"));
    }
}
