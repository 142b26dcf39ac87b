//! Child processes and external commands for `starfish bench`. Every child is stopped by its PID
//! when its guard drops (and is killed by the kernel if the bench itself dies, through
//! `PR_SET_PDEATHSIG`); every command runs under a deadline; scratch directories remove
//! themselves.

use std::fs::File;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const POLL: Duration = Duration::from_millis(20);
/// How long a child gets between SIGTERM and SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

static SEQUENCE: AtomicU64 = AtomicU64::new(0);

fn next_sequence() -> u64 {
    SEQUENCE.fetch_add(1, Ordering::Relaxed)
}

/// Children die with the bench: if it is killed, no element, host or client stays behind.
fn die_with_parent(cmd: &mut Command) {
    // SAFETY: the closure runs between fork and exec and only calls prctl, which is
    // async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// A running child process, stopped (SIGTERM, then SIGKILL) by its PID when dropped.
#[derive(Debug)]
pub struct Child {
    name: String,
    child: std::process::Child,
    log: Option<PathBuf>,
    stopped: bool,
}

impl Child {
    /// Starts `cmd` with stdout and stderr going to `log`.
    pub fn spawn(name: &str, cmd: &mut Command, log: &Path) -> Result<Child> {
        let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone().context("duplicating a log file handle")?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        die_with_parent(cmd);
        let child = cmd.spawn().with_context(|| format!("starting {name} ({:?})", cmd.get_program()))?;
        Ok(Child { name: name.to_string(), child, log: Some(log.to_path_buf()), stopped: false })
    }

    /// Starts `cmd` with the standard streams it was given (e.g. a pipe to read).
    pub fn spawn_piped(name: &str, cmd: &mut Command) -> Result<Child> {
        die_with_parent(cmd);
        let child = cmd.spawn().with_context(|| format!("starting {name} ({:?})", cmd.get_program()))?;
        Ok(Child { name: name.to_string(), child, log: None, stopped: false })
    }

    pub fn take_stdout(&mut self) -> Option<std::process::ChildStdout> {
        self.child.stdout.take()
    }

    /// Waits up to `timeout` for the child to exit by itself; then it is stopped.
    pub fn wait_bounded(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                self.stopped = true;
                return Ok(status);
            }
            if Instant::now() > deadline {
                self.stop(Duration::from_secs(1));
                bail!("{} did not exit within {} s", self.name, timeout.as_secs());
            }
            std::thread::sleep(POLL);
        }
    }

    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The last lines of the child's log, for error messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let Some(log) = &self.log else { return String::new() };
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Fails with the child's log if it has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.exited() {
            bail!("{} exited ({status}); its log ends with:\n{}", self.name, self.log_tail(20));
        }
        Ok(())
    }

    /// SIGKILL now (a crash), and reap it.
    pub fn kill9(&mut self) {
        self.stopped = true;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, up to `grace` to exit, then SIGKILL. Returns whether it had to be killed.
    pub fn stop(&mut self, grace: Duration) -> bool {
        if self.stopped {
            return false;
        }
        self.stopped = true;
        if self.exited().is_some() {
            return false;
        }
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: plain kill(2) on our own, not yet reaped, child.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return false;
            }
            std::thread::sleep(POLL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        true
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if self.stop(STOP_GRACE) {
            eprintln!("bench: {} did not stop on SIGTERM and was killed", self.name);
        }
    }
}

/// What a bounded command printed.
#[derive(Debug)]
pub struct Output {
    pub stdout: String,
    pub stderr: String,
}

/// Runs `cmd` to completion within `timeout` (killed after it), capturing its output through
/// files in `scratch`. A non-zero exit is an error carrying the end of stderr.
pub fn run_bounded(what: &str, cmd: &mut Command, timeout: Duration, scratch: &Path) -> Result<Output> {
    let n = next_sequence();
    let out_path = scratch.join(format!("cmd{n}.out"));
    let err_path = scratch.join(format!("cmd{n}.err"));
    let out = File::create(&out_path).with_context(|| format!("creating {}", out_path.display()))?;
    let err = File::create(&err_path).with_context(|| format!("creating {}", err_path.display()))?;
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    die_with_parent(cmd);
    let mut child = cmd.spawn().with_context(|| format!("{what}: starting {:?}", cmd.get_program()))?;
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().context("waiting for a command")? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{what} did not finish within {} s and was killed", timeout.as_secs());
        }
        std::thread::sleep(POLL);
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    let _ = std::fs::remove_file(&err_path);
    if !status.success() {
        let tail: String = stderr.chars().rev().take(2000).collect::<Vec<_>>().into_iter().rev().collect();
        bail!("{what} failed ({status}):\n{tail}");
    }
    Ok(Output { stdout, stderr })
}

/// Fails with the Debian package to install for each tool missing from PATH (or /sbin).
pub fn require_tools(tools: &[(&str, &str)]) -> Result<()> {
    let missing: Vec<String> = tools
        .iter()
        .filter(|(tool, _)| find_tool(tool).is_none())
        .map(|(tool, package)| format!("`{tool}` (install the package {package})"))
        .collect();
    if !missing.is_empty() {
        bail!("missing tool(s): {}", missing.join(", "));
    }
    Ok(())
}

pub fn find_tool(tool: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/sbin"])
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.is_file());
    found
}

/// A directory removed (with everything in it) when dropped.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    pub fn create(parent: &Path, prefix: &str) -> Result<ScratchDir> {
        let path = parent.join(format!("{prefix}-{}-{}", std::process::id(), next_sequence()));
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(ScratchDir(path))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A TCP port on 127.0.0.1 that nothing listens on, below the ephemeral range (so client
/// sockets do not take it meanwhile) and never handed out twice by this process.
pub fn free_port() -> Result<u16> {
    static HANDED_OUT: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u64)
        .unwrap_or(0);
    let mut state = nanos ^ (u64::from(std::process::id()) << 20);
    for _ in 0..1000 {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let port = 20000 + ((state >> 33) % 12000) as u16;
        if handed_out.contains(&port) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed_out.push(port);
            return Ok(port);
        }
    }
    bail!("no free TCP port found in 20000..32000")
}

/// Waits until something accepts connections on `address`, or `child` exits, or `timeout`.
pub fn wait_port(address: SocketAddr, timeout: Duration, child: &mut Child) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if TcpStream::connect_timeout(&address, Duration::from_millis(500)).is_ok() {
            return Ok(());
        }
        child.check_alive()?;
        if Instant::now() > deadline {
            bail!("nothing listens on {address} after {} s", timeout.as_secs());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
