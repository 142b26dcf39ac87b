//! The few Linux system calls the crate needs that std does not wrap: TUN devices, entering a
//! network namespace, poll with a stop event, timer slack, TCP_INFO, and stop signals. Every
//! `unsafe` block of the crate is here.

use std::ffi::CString;
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

fn check(result: libc::c_int) -> io::Result<libc::c_int> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

/// `struct ifreq` as TUNSETIFF reads it: the name, then the flags in the union.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _union_rest: [u8; 22],
}

/// Creates a TUN device (IP packets, no packet-information header) named `name` in the calling
/// thread's network namespace and returns its non-blocking descriptor. The device is not
/// persistent: it disappears when the descriptor is closed, also when the process dies.
pub fn open_tun(name: &str) -> io::Result<OwnedFd> {
    assert!(name.len() < libc::IFNAMSIZ, "interface names are at most 15 bytes");
    let path = CString::new("/dev/net/tun").expect("no NUL in a literal");
    // SAFETY: a valid NUL-terminated path; the result is checked.
    let fd = check(unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC) })?;
    // SAFETY: `fd` was just opened and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut request = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short,
        _union_rest: [0; 22],
    };
    request.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes a `struct ifreq`, which `IfReq` lays out (40 bytes).
    check(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &mut request as *mut IfReq) })?;
    Ok(fd)
}

/// Moves the calling thread into the network namespace bound at `path` (/var/run/netns/NAME).
/// Only this thread moves; sockets it creates stay in that namespace for their lifetime.
pub fn enter_net_namespace(path: &Path) -> io::Result<()> {
    let file = std::fs::File::open(path)?;
    // SAFETY: a valid descriptor of a namespace file; the result is checked.
    check(unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) })?;
    Ok(())
}

/// Lets the calling thread's sleeps end within about a microsecond of their deadline instead
/// of the default 50 µs slack: the relay holds packets for exact delays.
pub fn set_timer_slack_ns(slack_ns: u64) {
    // SAFETY: PR_SET_TIMERSLACK takes an unsigned long by value. Failure only costs precision.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, slack_ns as libc::c_ulong, 0, 0, 0);
    }
}

/// Asks for the lowest real-time priority (SCHED_FIFO 1) for the calling thread, so that the
/// relay wakes on time on a busy machine: it preempts ordinary processes only for the moments
/// it forwards a packet. Returns false (and changes nothing) without the privilege.
pub fn set_realtime_priority() -> bool {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: a valid sched_param for the calling thread (pid 0); the result is checked.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) == 0 }
}

/// Waits until `deadline` with the OS timer.
pub fn sleep_until(deadline: Instant) {
    loop {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        std::thread::sleep(deadline - now);
    }
}

/// An event that wakes threads blocked in [`wait_readable`].
#[derive(Debug)]
pub struct StopEvent {
    fd: OwnedFd,
    stopped: AtomicBool,
}

impl StopEvent {
    pub fn new() -> io::Result<StopEvent> {
        // SAFETY: plain flags; the result is checked.
        let fd = check(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        // SAFETY: `fd` was just created and is owned by nobody else.
        Ok(StopEvent { fd: unsafe { OwnedFd::from_raw_fd(fd) }, stopped: AtomicBool::new(false) })
    }

    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd. A full counter (EAGAIN) is
        // already signalled.
        unsafe {
            libc::write(self.fd.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8);
        }
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Wait {
    Readable,
    Stopped,
    TimedOut,
}

/// Blocks until `fd` is readable, `stop` fires, or `timeout_ms` passes (-1: no timeout).
pub fn wait_readable(fd: RawFd, stop: &StopEvent, timeout_ms: i32) -> io::Result<Wait> {
    let mut fds = [
        libc::pollfd { fd, events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: stop.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
    ];
    loop {
        if stop.is_stopped() {
            return Ok(Wait::Stopped);
        }
        // SAFETY: two valid pollfd entries; the result is checked.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        if ready < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        if stop.is_stopped() || fds[1].revents != 0 {
            return Ok(Wait::Stopped);
        }
        if ready == 0 {
            return Ok(Wait::TimedOut);
        }
        return Ok(Wait::Readable);
    }
}

/// One `read(2)`.
pub fn read(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for `buf.len()` bytes of writes.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len()) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// One `write(2)`; a TUN device takes a whole packet per write.
pub fn write(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for `buf.len()` bytes of reads.
    let n = unsafe { libc::write(fd, buf.as_ptr() as *const libc::c_void, buf.len()) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

pub fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// What the kernel's TCP reports about a connection.
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpInfo {
    /// Segments retransmitted over the connection's life.
    pub total_retrans: u32,
}

pub fn tcp_info(stream: &TcpStream) -> io::Result<TcpInfo> {
    // SAFETY: tcp_info is plain old data; zero is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is valid for `len` bytes; the kernel writes at most `len`.
    check(unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            &mut info as *mut _ as *mut libc::c_void,
            &mut len,
        )
    })?;
    Ok(TcpInfo { total_retrans: info.tcpi_total_retrans })
}

/// The congestion control algorithm of a connection (e.g. "cubic", "bbr").
pub fn tcp_congestion(stream: &TcpStream) -> io::Result<String> {
    let mut name = [0u8; 16];
    let mut len = name.len() as libc::socklen_t;
    // SAFETY: `name` is valid for `len` bytes.
    check(unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            name.as_mut_ptr() as *mut libc::c_void,
            &mut len,
        )
    })?;
    let end = name.iter().position(|&b| b == 0).unwrap_or(len as usize);
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}

static STOP_SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_: libc::c_int) {
    STOP_SIGNALLED.store(true, Ordering::SeqCst);
}

/// Turns SIGINT, SIGTERM and SIGHUP into a flag, so that a command holding a link tears it
/// down (the default action would kill the process and leave the namespaces behind).
pub fn catch_stop_signals() -> &'static AtomicBool {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(signal, on_stop_signal as *const () as libc::sighandler_t);
        }
    }
    &STOP_SIGNALLED
}
