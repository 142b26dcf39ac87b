//! Fewer wake-ups while a large message arrives: the socket's receive low-water mark
//! (`SO_RCVLOWAT`) set to what is still missing of it, so the kernel wakes the reader once
//! when enough has come, not at every segment (on loopback, every 64 KiB).
//!
//! The mark is never more than the sender still has to send of a message it sends whole (an
//! element frame, an NBD write's payload), so a reader always wakes. A stall timeout around a
//! read now means that not even the mark (at most [`LOW_WATER_MAX_BYTES`]) arrived in that
//! time: 2 MiB in 30 s is a link of 0.56 Mbit/s.

use std::os::fd::{AsRawFd, RawFd};

use tokio::net::TcpStream;

use crate::tls::Stream;

/// Below this many missing bytes the mark stays at one byte: a small rest is not worth the
/// system calls.
const LOW_WATER_MIN_BYTES: usize = 128 * 1024;
/// The mark never asks for more than this at once (a 1 MiB write's frame fits; the kernel
/// grows the receive buffer to about twice the mark).
pub const LOW_WATER_MAX_BYTES: usize = 2 << 20;

/// The receive low-water mark of one plain TCP connection (TLS and far-link streams keep the
/// default: the bytes missing from a message are not the bytes the socket still has to take).
pub struct LowWater {
    fd: Option<RawFd>,
    mark: usize,
}

impl LowWater {
    /// For `stream`'s socket; the caller keeps the stream (or its read half) open for as long as
    /// it uses this.
    pub fn of(stream: &Stream) -> LowWater {
        match stream {
            Stream::Plain(tcp) => LowWater::of_tcp(tcp),
            _ => LowWater { fd: None, mark: 1 },
        }
    }

    pub fn of_tcp(tcp: &TcpStream) -> LowWater {
        LowWater { fd: Some(tcp.as_raw_fd()), mark: 1 }
    }

    /// The mark now set (1 is the kernel's default).
    #[cfg(test)]
    fn mark(&self) -> usize {
        self.mark
    }

    /// `missing` bytes of the message being received are not in the reader's buffer yet, and
    /// its sender sends all of them without waiting for an answer: set the mark to them (at
    /// most [`LOW_WATER_MAX_BYTES`]), or back to one byte when few or none are missing.
    pub fn expect(&mut self, missing: usize) {
        let Some(fd) = self.fd else { return };
        let mark = if missing < LOW_WATER_MIN_BYTES { 1 } else { missing.min(LOW_WATER_MAX_BYTES) };
        if mark == self.mark {
            return;
        }
        let value = mark as libc::c_int;
        // SAFETY: `fd` is the open socket of the stream the caller keeps open; the value is a
        // c_int of the right size.
        let done = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                &value as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if done == 0 {
            self.mark = mark;
        } else {
            // Not fatal: reads only wake more often. Stop trying on this socket.
            tracing::debug!(error = %std::io::Error::last_os_error(), "SO_RCVLOWAT refused");
            self.fd = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
    };

    use super::*;

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let (client, accepted) = tokio::join!(TcpStream::connect(address), listener.accept());
        (client.expect("connect"), accepted.expect("accept").0)
    }

    fn kernel_mark(tcp: &TcpStream) -> usize {
        let mut value: libc::c_int = 0;
        let mut length = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: an open socket; value and length describe a c_int.
        let done = unsafe {
            libc::getsockopt(
                tcp.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                &mut value as *mut libc::c_int as *mut libc::c_void,
                &mut length,
            )
        };
        assert_eq!(done, 0, "getsockopt: {}", std::io::Error::last_os_error());
        value as usize
    }

    #[tokio::test]
    async fn the_mark_follows_what_is_missing() {
        let (_client, server) = pair().await;
        let mut low_water = LowWater::of_tcp(&server);
        assert_eq!(kernel_mark(&server), 1);
        low_water.expect(1 << 20);
        assert_eq!((low_water.mark(), kernel_mark(&server)), (1 << 20, 1 << 20));
        low_water.expect(LOW_WATER_MIN_BYTES - 1);
        assert_eq!((low_water.mark(), kernel_mark(&server)), (1, 1));
        low_water.expect(64 << 20);
        assert_eq!((low_water.mark(), kernel_mark(&server)), (LOW_WATER_MAX_BYTES, LOW_WATER_MAX_BYTES));
        low_water.expect(0);
        assert_eq!((low_water.mark(), kernel_mark(&server)), (1, 1));
    }

    /// The sender sends a message in pieces with pauses and then waits for an answer (the
    /// connection stays open and nothing follows, so only the mark can wake the reader): the
    /// reader, setting the mark to what is missing before each read, gets all of it, answers,
    /// and then gets a small message after it.
    #[tokio::test]
    async fn a_reader_with_the_mark_set_gets_the_whole_message_and_the_next() {
        const MESSAGE_BYTES: usize = 768 * 1024;
        const PIECE_BYTES: usize = 48 * 1024;
        let (mut client, mut server) = pair().await;
        let message: Vec<u8> = (0..MESSAGE_BYTES).map(|i| (i * 7 % 251) as u8).collect();
        let sent = message.clone();
        let sender = tokio::spawn(async move {
            for piece in sent.chunks(PIECE_BYTES) {
                client.write_all(piece).await.expect("send");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let mut answer = [0u8; 1];
            client.read_exact(&mut answer).await.expect("the answer");
            client.write_all(b"next").await.expect("send");
            // Keep the connection open until the reader is done.
            let _ = client.read(&mut answer).await;
        });
        let mut low_water = LowWater::of_tcp(&server);
        let mut received = Vec::with_capacity(MESSAGE_BYTES + 4);
        let read = async {
            for wanted in [MESSAGE_BYTES, MESSAGE_BYTES + 4] {
                while received.len() < wanted {
                    low_water.expect(wanted - received.len());
                    let read = server.read_buf(&mut received).await.expect("receive");
                    assert!(read > 0, "the sender closed early");
                }
                if wanted == MESSAGE_BYTES {
                    server.write_all(b"!").await.expect("answer");
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(20), read).await.expect("the reader was never woken");
        assert_eq!(&received[..MESSAGE_BYTES], &message[..]);
        assert_eq!(&received[MESSAGE_BYTES..], b"next");
        drop(server);
        sender.await.expect("sender");
    }
}
