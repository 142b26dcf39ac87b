//! The local socket: an element that listens on a loopback address is also reached, from the
//! same machine, over a Unix socket in Linux's abstract namespace named after that address.
//! A host element whose element address is a loopback one tries that socket first and falls
//! back to TCP when nothing listens there.
//!
//! Why: on loopback, TCP does work a Unix socket skips (segments, acknowledgements, its
//! timers); a small request and reply cost about a quarter less over a Unix socket on the
//! machines measured (docs/benchmarks.md, "the local socket").
//!
//! Who can connect: abstract socket names belong to the network namespace, as loopback
//! addresses do, so exactly the processes that reach the element's loopback port reach its
//! local socket, and no file is left behind by an element that dies. Sessions over it are
//! served as those over TCP: the same TLS handshake when TLS is configured, the same frame
//! checks for a stranger.
//!
//! A connected local socket is a [`LocalStream`], not tokio's `UnixStream`: it asks the
//! runtime to watch it for room to write only while a write waits for room. Linux wakes
//! whoever watches a Unix stream socket for room each time its peer takes a message from it,
//! whether or not its buffer was ever full (TCP wakes only a writer that found no room), so a
//! socket watched for both, as tokio's is, woke the sending process once per message its peer
//! read: a sleep and a wake-up more per request and per reply on each side
//! (docs/benchmarks.md, "the local socket's needless wake-ups").

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::UnixListener;

/// The send buffer a local socket asks for (`SO_SNDBUF`; Linux doubles it, and caps the request
/// at `net.core.wmem_max`). A Unix stream socket holds at most its sender's buffer of messages
/// not yet read; with the default (208 KiB here) a 1 MiB write crossed in five turns, each a
/// wake-up of both sides, and with room for a whole one, 1 MiB writes on tmpfs went 9 to 23 %
/// faster and the host element spent a quarter less CPU on each (docs/benchmarks.md,
/// 2026-12-02). Only bytes in flight are charged to it: an idle socket holds nothing.
const SEND_BUFFER_BYTES: libc::c_int = 2 << 20;

/// The least send buffer, as the kernel reports it (twice what was asked), that holds a whole
/// 1 MiB write's frame at once.
const SEND_BUFFER_BYTES_WANTED: usize = 2 << 20;

/// The send buffer of socket `fd`, as the kernel reports it.
fn send_buffer_bytes(fd: RawFd) -> io::Result<usize> {
    let mut got: libc::c_int = 0;
    let mut size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is an open socket; the kernel writes at most `size` bytes into `got`.
    let read = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            &mut got as *mut libc::c_int as *mut libc::c_void,
            &mut size,
        )
    };
    if read != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(got).unwrap_or(0))
}

/// Ask for [`SEND_BUFFER_BYTES`] of send buffer on local socket `fd`; the buffer it got.
/// Smaller than a 1 MiB write needs (`net.core.wmem_max` below 1 MiB), it says so once per
/// process: large writes still work, in several turns.
fn enlarge_send_buffer(fd: &OwnedFd) -> io::Result<usize> {
    let size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is an open socket; the option's value is a c_int of `size` bytes.
    let set = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            &SEND_BUFFER_BYTES as *const libc::c_int as *const libc::c_void,
            size,
        )
    };
    if set != 0 {
        return Err(io::Error::last_os_error());
    }
    let got = send_buffer_bytes(fd.as_raw_fd())?;
    static TOLD: std::sync::Once = std::sync::Once::new();
    if got < SEND_BUFFER_BYTES_WANTED {
        TOLD.call_once(|| {
            tracing::info!(
                send_buffer_bytes = got,
                "local sockets get {got} bytes of send buffer (net.core.wmem_max caps it): a 1 MiB write \
                 crosses in several turns; `sysctl net.core.wmem_max=1048576` or more lets it cross in one"
            )
        });
    }
    Ok(got)
}

/// The abstract name of the local socket of the element listening on `address`.
pub fn name(address: SocketAddr) -> String {
    format!("starfish-element@{address}")
}

/// What an element holds of its local socket's name for as long as it runs.
pub enum LocalSocket {
    /// Listening: host elements and peers on this machine connect here.
    Listening(UnixListener),
    /// The name held but not listened on (`--no-local-socket`): a connect is refused at once,
    /// and the caller goes over TCP. Held so that no other process can take the name and
    /// receive the sessions meant for this element.
    Held(#[allow(dead_code)] std::os::fd::OwnedFd),
}

/// Take the local socket's name of an element listening on `address` (its bound address, with
/// the port the system chose), listening on it or only holding it. `Ok(None)`: not a loopback
/// address, so there is no local socket. A name another process holds is an error: the
/// element must not serve while host elements on this machine would reach that process.
pub fn take(address: SocketAddr, listen: bool) -> io::Result<Option<LocalSocket>> {
    if !address.ip().is_loopback() {
        return Ok(None);
    }
    let name = name(address);
    let refused = |e: io::Error| io::Error::new(e.kind(), format!("cannot listen on the local socket @{name}: {e}"));
    let at = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    if listen {
        let listener = std::os::unix::net::UnixListener::bind_addr(&at).map_err(refused)?;
        listener.set_nonblocking(true)?;
        return UnixListener::from_std(listener).map(|l| Some(LocalSocket::Listening(l)));
    }
    Ok(Some(LocalSocket::Held(hold(&name).map_err(refused)?)))
}

/// Bind a socket to the abstract `name` without listening on it.
fn hold(name: &str) -> io::Result<std::os::fd::OwnedFd> {
    let fd = unix_socket(0)?;
    at_address(&fd, name, libc::bind)?;
    Ok(fd)
}

/// `call` (`bind` or `connect`) for socket `fd` and the abstract `name`.
fn at_address(
    fd: &std::os::fd::OwnedFd,
    name: &str,
    call: unsafe extern "C" fn(libc::c_int, *const libc::sockaddr, libc::socklen_t) -> libc::c_int,
) -> io::Result<()> {
    let (address, length) = abstract_address(name)?;
    // SAFETY: `fd` is an open socket; `address` is a valid `sockaddr_un` of `length` bytes.
    let done = unsafe {
        call(std::os::fd::AsRawFd::as_raw_fd(fd), &address as *const libc::sockaddr_un as *const libc::sockaddr, length)
    };
    match done {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// A new Unix stream socket, close-on-exec, with `flags` (`SOCK_NONBLOCK`) too.
fn unix_socket(flags: libc::c_int) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: a plain system call; a descriptor it returns is owned by nobody else.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | flags, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned here alone.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// The `sockaddr_un` of the abstract `name` (its path a NUL byte, then the name) and its length.
fn abstract_address(name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: all-zero bytes are a valid `sockaddr_un`.
    let mut address: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    address.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if name.len() + 1 > address.sun_path.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "name too long for a Unix socket"));
    }
    for (i, byte) in name.bytes().enumerate() {
        address.sun_path[i + 1] = byte as libc::c_char;
    }
    let length = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    Ok((address, length as libc::socklen_t))
}

/// Connect to the local socket of the element at `address`, if it is a loopback address and an
/// element listens there; `None` otherwise (the caller connects over TCP).
pub async fn connect(address: SocketAddr) -> Option<LocalStream> {
    if !address.ip().is_loopback() {
        return None;
    }
    // A non-blocking connect to a Unix socket finishes at once or fails at once: nothing
    // listens (the name is free, or held without listening), or its backlog is full (an
    // element that does not accept; TCP then tries, with its timeout).
    let fd = unix_socket(libc::SOCK_NONBLOCK).ok()?;
    at_address(&fd, &name(address), libc::connect).ok()?;
    LocalStream::new(fd).ok()
}

/// The descriptor number of [`Room::spare`], registered while a write waits; it does not close
/// the descriptor when dropped.
struct SpareFd(RawFd);

impl AsRawFd for SpareFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// A connected local socket (see the module's documentation): watched by the runtime for
/// reading always, and for room to write only while a write waits for it.
pub struct LocalStream {
    /// The socket, registered for reading only.
    socket: AsyncFd<OwnedFd>,
    /// How a write waits for room.
    room: Room,
}

impl LocalStream {
    /// Serve the connected, non-blocking Unix stream socket `fd` (within a tokio runtime).
    pub fn new(fd: OwnedFd) -> io::Result<LocalStream> {
        if let Err(error) = enlarge_send_buffer(&fd) {
            tracing::warn!(%error, "cannot size a local socket's send buffer; large messages cross in several turns");
        }
        let room = Room::of(fd.try_clone()?);
        // SAFETY: the `AsyncFd` owns `fd`, which stays open, the same descriptor, as long as it.
        let socket = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
        Ok(LocalStream { socket: socket.map_err(|e| e.into_parts().1)?, room })
    }

    /// An accepted tokio `UnixStream`, taken over (it leaves tokio's registration).
    pub fn from_tokio(stream: tokio::net::UnixStream) -> io::Result<LocalStream> {
        LocalStream::new(OwnedFd::from(stream.into_std()?))
    }

    /// A lender for this stream's large pieces (`crate::lending`), or `None` where lending is
    /// not safe in this process (a `SIGPIPE` that is not ignored) or its pipe cannot be made.
    pub fn lender(&self) -> Option<crate::lending::Lender> {
        crate::lending::Lender::new(self.socket.get_ref()).ok().flatten()
    }

    fn poll_send(&mut self, cx: &mut Context<'_>, send: impl FnMut(RawFd) -> isize) -> Poll<io::Result<usize>> {
        self.room.poll_send(cx, self.socket.as_raw_fd(), send)
    }
}

/// How a write to a socket registered for reading only waits for room: a second descriptor of
/// the socket (the kernel's readiness lists key a registration by descriptor, and the first one
/// is registered, for reading), registered for writing while a write waits.
pub(crate) struct Room {
    /// While a write waits for room: `spare` registered for writing. Declared before `spare`
    /// so that it is dropped (deregistered) before `spare` is closed.
    waiting: Option<AsyncFd<SpareFd>>,
    /// The second descriptor.
    spare: OwnedFd,
}

impl Room {
    /// Waits for room on `spare`, a descriptor of the socket no runtime watches.
    pub(crate) fn of(spare: OwnedFd) -> Room {
        Room { waiting: None, spare }
    }

    /// The second descriptor (itself never registered for reading).
    pub(crate) fn spare(&self) -> &OwnedFd {
        &self.spare
    }

    /// Run `send` (one non-blocking system call on socket `fd`: bytes sent, or -1 and errno)
    /// until it sends something or fails; while it finds no room, wait for room.
    pub(crate) fn poll_send(
        &mut self,
        cx: &mut Context<'_>,
        fd: RawFd,
        mut send: impl FnMut(RawFd) -> isize,
    ) -> Poll<io::Result<usize>> {
        loop {
            let sent = send(fd);
            if sent >= 0 {
                // No longer watched for room: the peer's reads wake nobody here again.
                self.waiting = None;
                return Poll::Ready(Ok(sent as usize));
            }
            let error = io::Error::last_os_error();
            match error.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {}
                _ => return Poll::Ready(Err(error)),
            }
            // Registering finds room that came after the failed send: no wake-up is lost.
            let waiting = match &mut self.waiting {
                Some(waiting) => waiting,
                None => {
                    let spare = SpareFd(self.spare.as_raw_fd());
                    // SAFETY: `spare` stays open, the same descriptor, until after `waiting` is
                    // dropped (the fields' order; `spare` is never replaced).
                    let registered = unsafe { AsyncFd::register_with_interest(spare, Interest::WRITABLE) };
                    self.waiting.insert(registered.map_err(|e| e.into_parts().1)?)
                }
            };
            ready!(waiting.poll_write_ready(cx))?.clear_ready();
        }
    }
}

/// `MSG_NOSIGNAL`: a peer gone is an `EPIPE` error, not a signal.
const SEND_FLAGS: libc::c_int = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT;

/// Most pieces one `sendmsg` takes (the kernel's `UIO_MAXIOV`); the caller sends the rest after.
const SEND_PIECES_MAX: usize = 1024;

impl AsyncRead for LocalStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let mut guard = ready!(this.socket.poll_read_ready(cx))?;
            // SAFETY: the kernel only writes into the unfilled part, and only the bytes it
            // reports are marked filled.
            let unfilled = unsafe { buf.unfilled_mut() };
            let room = unfilled.len();
            let received = guard.try_io(|socket| {
                // SAFETY: `unfilled` is valid for writes of its length for the whole call.
                let n = unsafe {
                    libc::recv(socket.as_raw_fd(), unfilled.as_mut_ptr().cast(), unfilled.len(), libc::MSG_DONTWAIT)
                };
                if n < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(n as usize)
            });
            match received {
                Ok(Ok(n)) => {
                    if 0 < n && n < room {
                        // A Unix stream read stops short when the socket had no more to give,
                        // so the next read waits for the runtime's next event instead of first
                        // finding nothing: one `recv` fewer per message (tokio does the same for
                        // its own sockets). Nothing is missed: the clearing leaves alone readiness
                        // from an event newer than this guard's, and bytes that come after the
                        // `recv` raise one. (A peer that attaches descriptors or out-of-band bytes
                        // can make a read stop short with more queued; only its own session then
                        // waits for its next bytes, or its stall timeout, as with tokio's.)
                        guard.clear_ready();
                    }
                    // SAFETY: the kernel wrote these `n` bytes.
                    unsafe { buf.assume_init(n) };
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for LocalStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.get_mut().poll_send(cx, |fd| {
            // SAFETY: `buf` is valid for reads of its length for the whole call.
            unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), SEND_FLAGS) }
        })
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let bufs = &bufs[..bufs.len().min(SEND_PIECES_MAX)];
        self.get_mut().poll_send(cx, |fd| {
            // SAFETY: all-zero bytes are a valid `msghdr` (no name, no control data).
            let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
            // `IoSlice` is ABI-compatible with `iovec` on Unix; the kernel only reads them.
            message.msg_iov = bufs.as_ptr() as *mut libc::iovec;
            message.msg_iovlen = bufs.len() as _;
            // SAFETY: `message` points at `bufs`, valid for the whole call.
            unsafe { libc::sendmsg(fd, &message, SEND_FLAGS) }
        })
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // SAFETY: a plain system call on the open socket.
        match unsafe { libc::shutdown(self.socket.as_raw_fd(), libc::SHUT_WR) } {
            0 => Poll::Ready(Ok(())),
            _ => Poll::Ready(Err(io::Error::last_os_error())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The events the kernel's readiness lists of this process watch descriptor `fd` for (from
    /// `/proc/self/fdinfo` of every epoll descriptor), or `None` if none watches it. An entry
    /// counts only if both its descriptor number and its file's inode are `fd`'s: other tests
    /// run beside this one in the same process, and a number closed and opened again by one of
    /// them must not be taken for ours.
    fn watched_for(fd: RawFd) -> Option<u32> {
        // SAFETY: all-zero bytes are a valid `stat`; `fstat` only writes into it.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a plain system call on a descriptor the caller holds open.
        assert_eq!(unsafe { libc::fstat(fd, &mut stat) }, 0, "fstat of an open descriptor");
        let inode = format!("ino:{:x}", stat.st_ino);
        for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
            let Ok(target) = std::fs::read_link(entry.path()) else { continue };
            if target.to_string_lossy() != "anon_inode:[eventpoll]" {
                continue;
            }
            let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", entry.file_name().to_string_lossy()));
            for line in info.unwrap_or_default().lines() {
                // "tfd:        7 events: 80002001 data: ... pos:0 ino:7524e sdev:9"
                let fields: Vec<&str> = line.split_whitespace().collect();
                if fields.len() >= 4
                    && fields[0] == "tfd:"
                    && fields[1] == fd.to_string()
                    && fields[2] == "events:"
                    && fields.contains(&inode.as_str())
                {
                    return Some(u32::from_str_radix(fields[3], 16).unwrap());
                }
            }
        }
        None
    }

    /// A connected pair: ours as a `LocalStream`, the peer as a plain tokio `UnixStream`.
    fn pair() -> (LocalStream, tokio::net::UnixStream) {
        let (ours, peer) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        peer.set_nonblocking(true).unwrap();
        (LocalStream::new(OwnedFd::from(ours)).unwrap(), tokio::net::UnixStream::from_std(peer).unwrap())
    }

    #[tokio::test]
    async fn a_local_stream_is_watched_for_room_only_while_a_write_waits_for_it() {
        let (mut ours, mut peer) = pair();
        let (socket, spare) = (ours.socket.as_raw_fd(), ours.room.spare.as_raw_fd());
        let out = libc::EPOLLOUT as u32;
        let watched = watched_for(socket).expect("the socket is registered");
        assert!(watched & libc::EPOLLIN as u32 != 0 && watched & out == 0, "events {watched:#x}");
        assert_eq!(watched_for(spare), None);
        // A write that finds room, read by the peer: nothing watches for room.
        ours.write_all(b"request").await.unwrap();
        let mut got = [0u8; 7];
        peer.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"request");
        assert_eq!(watched_for(spare), None);
        assert_eq!(watched_for(socket).unwrap() & out, 0);
        // A write larger than the socket's buffers waits for room, watched for it meanwhile.
        let sent: Vec<u8> = (0..8u32 << 20).map(|i| (i % 251) as u8).collect();
        let expected = sent.clone();
        let writer = tokio::spawn(async move {
            ours.write_all(&sent).await.unwrap();
            ours
        });
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while watched_for(spare).is_none_or(|events| events & out == 0) {
            assert!(tokio::time::Instant::now() < deadline, "a write waiting for room is watched for it");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let mut received = vec![0u8; expected.len()];
        peer.read_exact(&mut received).await.unwrap();
        assert!(received == expected, "every byte arrives, in order");
        let mut ours = writer.await.unwrap();
        // The write that found room at last ended the watch.
        assert_eq!(watched_for(spare), None);
        // Replies still arrive, and the end of the peer's stream reads as such.
        peer.write_all(b"reply").await.unwrap();
        drop(peer);
        let mut rest = Vec::new();
        ours.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"reply");
    }

    /// Whether the runtime holds `ours` readable now (without reading it).
    fn held_readable(ours: &LocalStream) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        ours.socket.poll_read_ready(&mut cx).is_ready()
    }

    #[tokio::test]
    async fn a_read_that_stops_short_waits_for_the_next_bytes_instead_of_reading_nothing_first() {
        let (mut ours, mut peer) = pair();
        let mut buffer = [0u8; 64];
        peer.write_all(b"ten bytes!").await.unwrap();
        assert_eq!(ours.read(&mut buffer).await.unwrap(), 10);
        // Short: the socket had nothing more, and the next read waits for an event.
        assert!(!held_readable(&ours), "a short read leaves the socket waiting for its next bytes");
        peer.write_all(b"five!").await.unwrap();
        let read = tokio::time::timeout(std::time::Duration::from_secs(10), ours.read(&mut buffer));
        assert_eq!(read.await.expect("bytes after a short read wake the reader").unwrap(), 5);
        assert_eq!(&buffer[..5], b"five!");
        // A read that fills the buffer proves nothing about what is left: it stays readable.
        peer.write_all(&[7u8; 100]).await.unwrap();
        assert_eq!(ours.read(&mut buffer).await.unwrap(), 64);
        assert!(held_readable(&ours), "a full read keeps the socket readable");
        assert_eq!(ours.read(&mut buffer).await.unwrap(), 36);
    }

    /// Many messages of many sizes, written while the reader reads in small pieces, so that
    /// short reads race new bytes: every byte arrives, in order, and no read waits forever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_racing_writes_miss_no_bytes() {
        let (mut ours, mut peer) = pair();
        let total: usize = (0..20_000).map(|i| 1 + i % 97).sum();
        let writer = tokio::spawn(async move {
            let mut next = 0u8;
            for i in 0..20_000usize {
                let message: Vec<u8> = (0..1 + i % 97)
                    .map(|_| {
                        next = next.wrapping_add(1);
                        next
                    })
                    .collect();
                peer.write_all(&message).await.unwrap();
                if i % 7 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            peer
        });
        let mut received = Vec::with_capacity(total);
        let mut buffer = [0u8; 64];
        let deadline = std::time::Duration::from_secs(30);
        while received.len() < total {
            let n = tokio::time::timeout(deadline, ours.read(&mut buffer))
                .await
                .expect("a read with bytes on their way completes")
                .unwrap();
            assert!(n > 0, "the peer is still open");
            received.extend_from_slice(&buffer[..n]);
        }
        let _peer = writer.await.unwrap();
        let expected: Vec<u8> = (1..=total).map(|i| i as u8).collect();
        assert!(received == expected, "every byte arrives, in order");
    }

    #[tokio::test]
    async fn a_write_to_a_local_stream_whose_peer_is_gone_fails() {
        let (mut ours, peer) = pair();
        drop(peer);
        let error = ours.write_all(&[7u8; 1 << 20]).await.expect_err("nobody reads");
        assert_eq!(error.kind(), io::ErrorKind::BrokenPipe, "{error}");
        assert_eq!(ours.read(&mut [0u8; 16]).await.unwrap(), 0, "the peer's end reads as the end");
    }

    /// A local stream asks for room for a whole 1 MiB write, as much as `net.core.wmem_max`
    /// allows; where it allows enough, 1 MiB and more go into the socket in one send while its
    /// peer reads nothing.
    #[tokio::test]
    async fn a_local_stream_holds_a_whole_large_write_in_flight() {
        let mut fds = [0; 2];
        // SAFETY: a plain system call filling `fds` with two new descriptors owned here.
        let made = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        assert_eq!(made, 0, "{}", io::Error::last_os_error());
        use std::os::fd::FromRawFd;
        // SAFETY: both descriptors were just made and are owned here alone.
        let (ours, peer) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let raw = ours.as_raw_fd();
        let _stream = LocalStream::new(ours).expect("stream");
        let wmem_max = std::fs::read_to_string("/proc/sys/net/core/wmem_max")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .expect("net.core.wmem_max");
        let got = send_buffer_bytes(raw).expect("SO_SNDBUF");
        assert_eq!(got, 2 * (SEND_BUFFER_BYTES as usize).min(wmem_max), "SO_SNDBUF as asked, capped");
        if got < SEND_BUFFER_BYTES_WANTED {
            eprintln!("net.core.wmem_max is {wmem_max}: a 1 MiB write does not fit here; not tested further");
            return;
        }
        let message = vec![7u8; (1 << 20) + 4096];
        // SAFETY: `raw` is open while `_stream` lives; `message` is readable for its length.
        let sent =
            unsafe { libc::send(raw, message.as_ptr() as *const libc::c_void, message.len(), libc::MSG_DONTWAIT) };
        assert_eq!(sent, message.len() as isize, "the whole write in flight at once");
        drop(peer);
    }

    #[tokio::test]
    async fn an_element_on_loopback_is_reached_over_its_local_socket() {
        // No TCP port is bound: the name is only a name, made unique per test and process.
        let address = SocketAddr::new("127.0.0.1".parse().unwrap(), 40000 + (std::process::id() % 20000) as u16);
        let Some(LocalSocket::Listening(listener)) = take(address, true).unwrap() else {
            panic!("a loopback address has a local socket")
        };
        let accepted = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut got = [0u8; 5];
            stream.read_exact(&mut got).await.unwrap();
            got
        });
        let mut stream = connect(address).await.expect("the local socket answers");
        stream.write_all(b"hello").await.unwrap();
        assert_eq!(&accepted.await.unwrap(), b"hello");
    }

    #[tokio::test]
    async fn a_full_backlog_fails_the_connect_at_once_instead_of_waiting() {
        let address = SocketAddr::new("127.0.0.1".parse().unwrap(), 1000 + (std::process::id() % 20000) as u16);
        let held = hold(&name(address)).unwrap();
        // SAFETY: an open, bound socket; a backlog of 0 queues one connection and refuses more.
        assert_eq!(unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&held), 0) }, 0);
        let _queued = connect(address).await.expect("one connection is queued");
        let refused = tokio::time::timeout(std::time::Duration::from_secs(5), connect(address)).await;
        assert!(matches!(refused, Ok(None)), "a connect to a full backlog must fail at once");
    }

    #[tokio::test]
    async fn no_local_socket_off_loopback_or_where_nothing_listens() {
        let remote: SocketAddr = "192.0.2.7:7000".parse().unwrap();
        assert!(take(remote, true).unwrap().is_none());
        assert!(connect(remote).await.is_none());
        let nobody: SocketAddr = "127.0.0.1:9".parse().unwrap();
        assert!(connect(nobody).await.is_none(), "nothing listens on the local socket of port 9");
    }

    #[tokio::test]
    async fn a_name_taken_is_refused_with_the_name_and_a_held_name_refuses_connections() {
        let address = SocketAddr::new("127.0.0.1".parse().unwrap(), 20000 + (std::process::id() % 20000) as u16);
        let held = take(address, false).unwrap().unwrap();
        assert!(matches!(held, LocalSocket::Held(_)));
        assert!(connect(address).await.is_none(), "a held name takes no connection");
        for listen in [true, false] {
            let error = take(address, listen).err().expect("the name is held");
            assert!(error.to_string().contains(&name(address)), "{error}");
        }
        drop(held);
        assert!(matches!(take(address, true).unwrap(), Some(LocalSocket::Listening(_))), "the name is free again");
    }
}
