//! Large pieces sent over a local socket without copying them.
//!
//! A `send` copies its bytes into the socket: for a 1 MiB write the host element copies the
//! data once per element on this machine, and each copy is a tenth of the host element's CPU
//! at 1 MiB writes (docs/benchmarks.md, "where 1 MiB writes on tmpfs spend the CPU"). A
//! [`Lender`] instead maps the pieces' pages into a pipe (`vmsplice`) and moves them from the
//! pipe into the socket (`splice`, which attaches the pages to the socket's buffers instead of
//! copying them): the peer then copies them out of our pages when it reads, as it copies any
//! message.
//!
//! The pages are lent, not given: until the peer has read them, the kernel refers to our
//! memory, and whatever we write there afterwards is what the peer reads. So the lender keeps
//! a reference to each piece it lent (a `Bytes`, which nobody writes to) until the peer has
//! read it: the socket's count of bytes not yet taken by the peer (`SIOCOUTQ`, memory charged
//! to our end for its messages in flight, at least their length; a unit test below checks it)
//! tells, with the bytes sent so far, which pieces the peer has read past. A lender dropped
//! while the peer has not read everything hands the pieces to a task that waits for that (or
//! for the peer to close), so no piece is freed and reused while the kernel holds its pages.
//!
//! Only plain local sockets lend: TLS encrypts into its own buffers, and TCP on loopback copies
//! such pages at delivery anyway. And only the host element lends, to its elements: an
//! element's large read replies, lent, made 1 MiB reads 7–11 % slower: the host element, the
//! busiest process at large reads, spent up to 16 % more CPU per read, the elements about as
//! much less (docs/benchmarks.md).

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use bytes::Bytes;

use crate::local_socket::Room;

/// Pieces at least this large are lent; smaller ones are copied (a lent piece costs two or
/// three system calls more than a copy, and a copy of 64 KiB already costs more than those).
pub const LEND_BYTES_MIN: usize = 64 * 1024;

/// The pipe's size asked for: a 1 MiB piece goes in at once (`fs.pipe-max-size`, 1 MiB by
/// default, allows it; a smaller pipe takes a piece in several turns).
const PIPE_BYTES: libc::c_int = 1 << 20;

/// Most pieces one `vmsplice` takes (the kernel's `UIO_MAXIOV`); the rest go in the next turn.
const IOVECS_MAX: usize = 1024;

/// How often a dropped lender's pieces are checked for having been read.
const DROPPED_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// Sends large pieces over one local socket without copying them (see the module's
/// documentation). Its owner writes everything else through the stream and tells the lender
/// how much ([`Lender::wrote`]), in the order it went out.
pub struct Lender {
    /// A descriptor of the socket of its own, registered for writing while a lend waits.
    room: Room,
    /// The pipe pages pass through: (read end, write end), both non-blocking.
    pipe: (OwnedFd, OwnedFd),
    /// Bytes sent on the socket so far: lent, and written by the stream.
    sent: u64,
    /// Pieces the kernel may still refer to, in order, each with the count of bytes sent on the
    /// socket at its end.
    held: VecDeque<(u64, Bytes)>,
}

impl Lender {
    /// A lender for `socket` (a connected, non-blocking Unix stream socket), or `None` if this
    /// process does not ignore `SIGPIPE`: `splice` to a socket whose peer is gone raises it,
    /// as `send` without `MSG_NOSIGNAL` does (Rust programs ignore it from the start).
    pub fn new(socket: &OwnedFd) -> io::Result<Option<Lender>> {
        if !sigpipe_ignored() {
            return Ok(None);
        }
        let room = Room::of(socket.try_clone()?);
        let mut ends = [0 as libc::c_int; 2];
        // SAFETY: `ends` has room for the two descriptors.
        if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both were just opened and are owned here alone.
        let pipe = unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
        // A smaller pipe only takes more turns: the error is not one.
        // SAFETY: a plain system call on an open pipe.
        unsafe { libc::fcntl(pipe.1.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_BYTES) };
        Ok(Some(Lender { room, pipe, sent: 0, held: VecDeque::new() }))
    }

    /// The stream wrote `bytes` to the socket, after everything lent so far.
    pub fn wrote(&mut self, bytes: usize) {
        self.sent += bytes as u64;
    }

    /// Send all of `pieces` on the socket, in order, after everything sent before them, without
    /// copying them; the lender keeps each until the peer has read it. Cancelled, it leaves the
    /// stream with part of them sent, as a cancelled write does.
    pub async fn lend(&mut self, pieces: &[Bytes]) -> io::Result<()> {
        self.release()?;
        let mut end = self.sent;
        for piece in pieces.iter().filter(|piece| !piece.is_empty()) {
            end += piece.len() as u64;
            self.held.push_back((end, piece.clone()));
        }
        let total: usize = pieces.iter().map(Bytes::len).sum();
        // What is mapped into the pipe so far: whole pieces, then `offset` bytes of the next.
        let (mut index, mut offset) = (0usize, 0usize);
        let (mut mapped, mut in_pipe) = (0usize, 0usize);
        while mapped < total || in_pipe > 0 {
            if mapped < total {
                let iovecs: Vec<libc::iovec> = pieces[index..]
                    .iter()
                    .enumerate()
                    .map(|(i, piece)| if i == 0 { &piece[offset..] } else { &piece[..] })
                    .filter(|rest| !rest.is_empty())
                    .take(IOVECS_MAX)
                    .map(|rest| libc::iovec { iov_base: rest.as_ptr() as *mut libc::c_void, iov_len: rest.len() })
                    .collect();
                // SAFETY: `iovecs` describe memory of `pieces`, which `held` keeps alive and which
                // nobody writes to (each a `Bytes`) for as long as the kernel may refer to it.
                let n = unsafe {
                    libc::vmsplice(self.pipe.1.as_raw_fd(), iovecs.as_ptr(), iovecs.len(), libc::SPLICE_F_NONBLOCK)
                };
                if n > 0 {
                    let n = n as usize;
                    mapped += n;
                    in_pipe += n;
                    offset += n;
                    while index < pieces.len() && offset >= pieces[index].len() {
                        offset -= pieces[index].len();
                        index += 1;
                    }
                } else {
                    let error = io::Error::last_os_error();
                    match error.kind() {
                        io::ErrorKind::Interrupted => continue,
                        // The pipe is full: empty it first.
                        io::ErrorKind::WouldBlock if in_pipe > 0 => {}
                        _ => return Err(error),
                    }
                }
            }
            let pipe = self.pipe.0.as_raw_fd();
            let socket = self.room.spare().as_raw_fd();
            let moved = std::future::poll_fn(|cx| {
                self.room.poll_send(cx, socket, |fd| {
                    // SAFETY: plain system call on open descriptors; no offsets (a pipe and a
                    // socket have none).
                    unsafe {
                        libc::splice(
                            pipe,
                            std::ptr::null_mut(),
                            fd,
                            std::ptr::null_mut(),
                            in_pipe,
                            libc::SPLICE_F_NONBLOCK,
                        )
                    }
                })
            })
            .await?;
            if moved == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            in_pipe -= moved;
            self.sent += moved as u64;
        }
        Ok(())
    }

    /// Let go of the pieces the peer has read: before each lend, and before each write of
    /// copied bytes ([`crate::outgoing::Outgoing::write_to`]; a heartbeat goes out every
    /// 100 ms), so that pieces lent in a burst are not held while nothing large follows. One
    /// system call, only while some piece is held.
    pub fn release(&mut self) -> io::Result<()> {
        if self.held.is_empty() {
            return Ok(());
        }
        let unread = unread_bytes(self.room.spare())?;
        let read_through = self.sent.saturating_sub(unread);
        while self.held.front().is_some_and(|(end, _)| *end <= read_through) {
            self.held.pop_front();
        }
        Ok(())
    }

    /// Pieces held (for tests).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.held.len()
    }
}

impl Drop for Lender {
    fn drop(&mut self) {
        if self.release().is_ok() && self.held.is_empty() {
            return;
        }
        let held = std::mem::take(&mut self.held);
        // The kernel may still refer to these pieces' pages: keep them until the peer has read
        // or closed (the socket's count of unread bytes is then 0), which this descriptor of the
        // socket lets us ask.
        let Ok(socket) = self.room.spare().try_clone() else {
            held.into_iter().for_each(std::mem::forget);
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime: the process is ending. Never freed is safe.
            held.into_iter().for_each(std::mem::forget);
            return;
        };
        runtime.spawn(async move {
            loop {
                match unread_bytes(&socket) {
                    Ok(0) => break,
                    Ok(_) => tokio::time::sleep(DROPPED_CHECK_INTERVAL).await,
                    Err(_) => {
                        held.into_iter().for_each(std::mem::forget);
                        return;
                    }
                }
            }
            drop(held);
        });
    }
}

/// Bytes the socket's peer has not read yet, as the socket's memory charged for them: at
/// least their count.
fn unread_bytes(socket: &OwnedFd) -> io::Result<u64> {
    let mut unread: libc::c_int = 0;
    // `SIOCOUTQ` is `TIOCOUTQ`'s number (the libc crate names only the latter).
    // SAFETY: `SIOCOUTQ` writes one `int` to the pointer given.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::TIOCOUTQ, &mut unread) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u64::try_from(unread).unwrap_or(0))
}

/// Whether `SIGPIPE` is ignored in this process.
fn sigpipe_ignored() -> bool {
    // SAFETY: all-zero bytes are a valid `sigaction`; the call only reads the disposition.
    let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a null new action asks only for the current one, written to `current`.
    let asked = unsafe { libc::sigaction(libc::SIGPIPE, std::ptr::null(), &mut current) };
    asked == 0 && current.sa_sigaction == libc::SIG_IGN
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use tokio::io::AsyncReadExt;

    use super::*;
    use crate::local_socket::LocalStream;
    use crate::outgoing::Outgoing;

    /// Memory that says when it is freed.
    struct Tracked(Vec<u8>, Arc<AtomicBool>);

    impl AsRef<[u8]> for Tracked {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.1.store(true, Ordering::SeqCst);
        }
    }

    /// A piece of `bytes` bytes (a pattern seeded with `seed`) and the flag its memory sets when
    /// freed.
    fn tracked(bytes: usize, seed: u8) -> (Bytes, Arc<AtomicBool>) {
        let freed = Arc::new(AtomicBool::new(false));
        let data = (0..bytes).map(|i| (i % 251) as u8 ^ seed).collect();
        (Bytes::from_owner(Tracked(data, freed.clone())), freed)
    }

    /// Lend a piece of `bytes` bytes and drop our own reference to it: the flag says when the
    /// lender lets go of it too.
    async fn lend_and_let_go(lender: &mut Lender, bytes: usize, seed: u8) -> Arc<AtomicBool> {
        let (piece, freed) = tracked(bytes, seed);
        lender.lend(&[piece]).await.unwrap();
        freed
    }

    /// A connected pair: ours as a `LocalStream` with its lender, the peer as a tokio socket.
    fn pair() -> (LocalStream, Lender, tokio::net::UnixStream) {
        let (ours, peer) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        peer.set_nonblocking(true).unwrap();
        let ours = LocalStream::new(OwnedFd::from(ours)).unwrap();
        let lender = ours.lender().expect("Rust programs ignore SIGPIPE");
        (ours, lender, tokio::net::UnixStream::from_std(peer).unwrap())
    }

    #[tokio::test]
    async fn lent_pieces_arrive_in_order_among_copied_ones() {
        let (mut ours, mut lender, mut peer) = pair();
        // Larger than the socket's buffers and the pipe (the lend waits for room and takes
        // turns), one not starting on a page, small ones between them.
        let (large, _) = tracked(3 << 20, 1);
        let odd = large.slice(777..777 + 100_000);
        let pieces = [
            Bytes::from_static(b"head"),
            large.clone(),
            Bytes::from(vec![9u8; 5000]),
            odd,
            Bytes::from_static(b"tail"),
        ];
        let expected: Vec<u8> = pieces.iter().flat_map(|piece| piece.iter().copied()).collect();
        let small = [Bytes::from(vec![3u8; 20_000]), Bytes::from_static(b"end")];
        let expected_small: Vec<u8> = small.iter().flat_map(|piece| piece.iter().copied()).collect();
        let writer = tokio::spawn(async move {
            let mut queue = Outgoing::new();
            pieces.iter().for_each(|piece| queue.push(piece));
            queue.write_to(&mut ours, Some(&mut lender)).await.unwrap();
            assert!(lender.held() > 0, "lent");
            let lent = lender.sent;
            // Without a large piece the queue is copied, and the lender told.
            small.iter().for_each(|piece| queue.push(piece));
            queue.write_to(&mut ours, Some(&mut lender)).await.unwrap();
            (lent, lender)
        });
        let mut received = vec![0u8; expected.len()];
        peer.read_exact(&mut received).await.unwrap();
        assert!(received == expected, "every byte arrives, in order");
        let mut received_small = vec![0u8; expected_small.len()];
        peer.read_exact(&mut received_small).await.unwrap();
        assert!(received_small == expected_small, "and what was copied after it");
        let (lent, lender) = writer.await.unwrap();
        assert_eq!(lent, expected.len() as u64, "the lender counts what it lent");
        assert_eq!(lender.sent, (expected.len() + expected_small.len()) as u64, "and what was written beside it");
    }

    #[tokio::test]
    async fn a_lent_piece_is_held_until_the_peer_has_read_it() {
        let (_ours, mut lender, mut peer) = pair();
        let freed = lend_and_let_go(&mut lender, 100 << 10, 2).await;
        lender.release().unwrap();
        assert!(!freed.load(Ordering::SeqCst), "the kernel still refers to the piece's pages");
        assert_eq!(lender.held(), 1);
        let mut received = vec![0u8; 60 << 10];
        peer.read_exact(&mut received).await.unwrap();
        lender.release().unwrap();
        assert!(!freed.load(Ordering::SeqCst), "the peer has read only part of it");
        let mut rest = vec![0u8; 40 << 10];
        peer.read_exact(&mut rest).await.unwrap();
        lender.release().unwrap();
        assert!(freed.load(Ordering::SeqCst), "read, the piece is let go");
        assert_eq!(lender.held(), 0);
        assert_eq!(received[1], 1 ^ 2, "the bytes are the piece's");
    }

    /// What `release` rests on: the socket's count of unread bytes is never below the bytes
    /// sent and not yet read, for copied and for lent ones, however much of a message was read.
    #[tokio::test]
    async fn the_unread_count_covers_every_byte_the_peer_has_not_read() {
        let (mut ours, mut lender, mut peer) = pair();
        let (piece, _) = tracked(150 << 10, 3);
        let mut queue = Outgoing::new();
        queue.push(&Bytes::from(vec![5u8; 10_000]));
        queue.push(&piece);
        queue.push(&Bytes::from(vec![6u8; 3000]));
        queue.write_to(&mut ours, Some(&mut lender)).await.unwrap();
        let total = lender.sent;
        let mut read = 0u64;
        for step in [1usize, 4095, 5904, 1, 70_000, 30_000, 50_000, 6599] {
            let mut buf = vec![0u8; step];
            peer.read_exact(&mut buf).await.unwrap();
            read += step as u64;
            let unread = unread_bytes(lender.room.spare()).unwrap();
            assert!(unread >= total - read, "unread {unread} counted for {} bytes not read", total - read);
        }
        assert_eq!(read, total);
        assert_eq!(unread_bytes(lender.room.spare()).unwrap(), 0);
    }

    /// Pieces lent in a burst are let go once read, at the next write of copied bytes (a
    /// heartbeat, a small write), without waiting for another lend.
    #[tokio::test]
    async fn a_write_of_copied_bytes_lets_go_of_the_lent_pieces_read() {
        let (mut ours, mut lender, mut peer) = pair();
        let freed = lend_and_let_go(&mut lender, 200 << 10, 6).await;
        let mut received = vec![0u8; 200 << 10];
        peer.read_exact(&mut received).await.unwrap();
        assert!(!freed.load(Ordering::SeqCst), "held until the lender looks");
        let mut queue = Outgoing::new();
        queue.push(&Bytes::from_static(b"ping"));
        queue.write_to(&mut ours, Some(&mut lender)).await.unwrap();
        assert!(freed.load(Ordering::SeqCst), "read, the piece is let go at the next small write");
        assert_eq!(lender.held(), 0);
        // A piece not yet read stays held through such a write.
        let unread = lend_and_let_go(&mut lender, 200 << 10, 7).await;
        queue.push(&Bytes::from_static(b"pong"));
        queue.write_to(&mut ours, Some(&mut lender)).await.unwrap();
        assert!(!unread.load(Ordering::SeqCst), "unread, the piece is kept");
        assert_eq!(lender.held(), 1);
    }

    #[tokio::test]
    async fn a_dropped_lender_keeps_its_pieces_until_the_peer_has_read_them() {
        let (_ours, mut lender, mut peer) = pair();
        let freed = lend_and_let_go(&mut lender, 100 << 10, 4).await;
        drop(lender);
        tokio::time::sleep(3 * DROPPED_CHECK_INTERVAL).await;
        assert!(!freed.load(Ordering::SeqCst), "unread, the piece is kept after the lender is gone");
        let mut received = vec![0u8; 100 << 10];
        peer.read_exact(&mut received).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !freed.load(Ordering::SeqCst) {
            assert!(tokio::time::Instant::now() < deadline, "read, the piece is let go");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn lending_to_a_peer_that_is_gone_fails() {
        let (_ours, mut lender, peer) = pair();
        drop(peer);
        let (piece, _) = tracked(1 << 20, 5);
        let error = lender.lend(&[piece]).await.expect_err("nobody reads");
        assert_eq!(error.kind(), io::ErrorKind::BrokenPipe, "{error}");
    }
}
