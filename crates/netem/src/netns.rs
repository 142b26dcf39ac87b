//! Network namespaces and the `ip` tool: creating and deleting named namespaces, running code
//! inside one, and making sure none outlives the process that created it.
//!
//! Every namespace is named `sfn-<pid>-<n>-<side>`. Three things remove it: the owner's `Drop`;
//! a watchdog shell started with the link, which deletes the namespaces when the owner dies
//! without running `Drop` (SIGKILL, an abort, Ctrl-C on a test run); and
//! [`remove_leftovers`], which deletes namespaces whose owner pid no longer exists.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};

use crate::sys;
use crate::LinkError;

/// The prefix of every namespace and device the crate creates.
pub const NAME_PREFIX: &str = "sfn-";

const NETNS_DIR: &str = "/var/run/netns";

/// Runs `ip` with `args`; the error carries its stderr.
pub fn ip(args: &[&str]) -> Result<(), LinkError> {
    let output = Command::new("ip").args(args).stdin(Stdio::null()).output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            LinkError::ToolMissing("ip (Debian package iproute2)")
        } else {
            LinkError::Io { what: "running ip".into(), source: e }
        }
    })?;
    if output.status.success() {
        Ok(())
    } else {
        Err(LinkError::Command {
            command: format!("ip {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
        })
    }
}

/// Runs `ip` with `args` and returns its stdout.
pub fn ip_output(args: &[&str]) -> Result<String, LinkError> {
    let output = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| LinkError::Io { what: "running ip".into(), source: e })?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(LinkError::Command {
            command: format!("ip {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
        })
    }
}

/// Checks that this process can create namespaces and TUN devices.
pub fn check_prerequisites() -> Result<(), LinkError> {
    if !sys::is_root() {
        return Err(LinkError::NotRoot);
    }
    if !Path::new("/dev/net/tun").exists() {
        return Err(LinkError::NoTun);
    }
    ip_output(&["-V"]).map(|_| ()).map_err(|e| match e {
        LinkError::Io { .. } => LinkError::ToolMissing("ip (Debian package iproute2)"),
        other => other,
    })
}

/// A named network namespace, deleted on drop.
#[derive(Debug)]
pub struct Namespace {
    name: String,
    deleted: bool,
}

impl Namespace {
    pub fn create(name: String) -> Result<Namespace, LinkError> {
        assert!(name.starts_with(NAME_PREFIX), "every namespace carries the prefix cleanup looks for");
        ip(&["netns", "add", &name])?;
        let namespace = Namespace { name, deleted: false };
        ip(&["-n", &namespace.name, "link", "set", "lo", "up"])?;
        Ok(namespace)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.name)
    }

    /// Runs `f` on a new thread inside this namespace and returns its result. Sockets and
    /// devices `f` creates belong to the namespace.
    pub fn run_in<T: Send, F: FnOnce() -> T + Send>(&self, f: F) -> Result<T, LinkError> {
        let path = self.path();
        std::thread::scope(|scope| {
            scope
                .spawn(move || {
                    sys::enter_net_namespace(&path).map_err(|e| LinkError::Io {
                        what: format!("entering namespace {}", path.display()),
                        source: e,
                    })?;
                    Ok(f())
                })
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }
}

impl Namespace {
    /// Deletes the namespace now, reporting failure (dropping it deletes it too, logging).
    pub fn delete(mut self) -> Result<(), LinkError> {
        self.deleted = true;
        ip(&["netns", "del", &self.name])
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            tracing::warn!(namespace = %self.name, error = %e, "could not delete network namespace");
        }
    }
}

/// A shell that deletes the given namespaces if this process dies without releasing it. It
/// waits for a line on its stdin: `done` means the owner cleaned up; end of file means the
/// owner died. It runs in its own process group so that Ctrl-C on a terminal does not kill it
/// together with its owner.
#[derive(Debug)]
pub struct Watchdog {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Watchdog {
    pub fn start(namespaces: &[String]) -> Result<Watchdog, LinkError> {
        use std::os::unix::process::CommandExt;
        let mut script = String::from("read -r line; [ \"$line\" = done ] && exit 0;");
        for name in namespaces {
            assert!(name.starts_with(NAME_PREFIX) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
            script.push_str(&format!(" ip netns del {name};"));
        }
        let mut child = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| LinkError::Io { what: "starting the cleanup watchdog (sh)".into(), source: e })?;
        let stdin = child.stdin.take();
        Ok(Watchdog { child, stdin })
    }

    /// The owner has removed everything; the watchdog exits without doing anything.
    pub fn release(mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.write_all(b"done\n");
        }
        let _ = self.child.wait();
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // Dropped without `release` (an error path while creating the link): closing stdin
        // makes the watchdog delete whatever was created.
        if let Some(stdin) = self.stdin.take() {
            drop(stdin);
            let _ = self.child.wait();
        }
    }
}

/// The pid in a name `sfn-<pid>-…`.
fn owner_pid(name: &str) -> Option<u32> {
    name.strip_prefix(NAME_PREFIX)?.split('-').next()?.parse().ok()
}

/// Deletes namespaces named `sfn-<pid>-…` whose process no longer exists (left by a process
/// killed before its watchdog could run). Returns the names deleted.
pub fn remove_leftovers() -> Result<Vec<String>, LinkError> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(NETNS_DIR) else {
        return Ok(removed);
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = owner_pid(&name) else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        // Another process may be removing the same leftover right now.
        match ip(&["netns", "del", &name]) {
            Ok(()) => removed.push(name),
            Err(e) => {
                tracing::debug!(namespace = %name, error = %e, "could not remove a leftover namespace")
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pids() {
        let table = [("sfn-123-4-a", Some(123)), ("sfn-9-0-b", Some(9)), ("sfn-x-1-a", None), ("other-123-1", None)];
        for (name, pid) in table {
            assert_eq!(owner_pid(name), pid, "{name}");
        }
    }
}
