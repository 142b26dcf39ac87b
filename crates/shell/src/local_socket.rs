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

use std::io;
use std::net::SocketAddr;
use std::os::linux::net::SocketAddrExt;

use tokio::net::{UnixListener, UnixStream};

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
pub async fn connect(address: SocketAddr) -> Option<UnixStream> {
    if !address.ip().is_loopback() {
        return None;
    }
    // A non-blocking connect to a Unix socket finishes at once or fails at once: nothing
    // listens (the name is free, or held without listening), or its backlog is full (an
    // element that does not accept; TCP then tries, with its timeout).
    let fd = unix_socket(libc::SOCK_NONBLOCK).ok()?;
    at_address(&fd, &name(address), libc::connect).ok()?;
    UnixStream::from_std(std::os::unix::net::UnixStream::from(fd)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
