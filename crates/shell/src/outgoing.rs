//! Frames queued for one connection, written with as few system calls as they fit in.
//!
//! A writer task used to pass each piece of a frame through a `BufWriter`: small pieces were
//! copied into its buffer, and a piece at least as large as the buffer (a large write's data)
//! went out on its own, after the buffer was flushed. A 1 MiB write thus took three `sendto`s
//! per element (its 42-byte head, its data, its 1 KiB of piece checksums), each a trip through
//! loopback TCP to the element. Here small pieces are still gathered into one staging buffer,
//! larger ones are kept as they are, shared, never copied, and [`Outgoing::write_to`] hands
//! them all to the socket in vectored writes, or, on a host element's local socket, lends
//! them to it when one is large (`crate::lending`).

use std::io::IoSlice;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::lending::{Lender, LEND_BYTES_MIN};

/// Pieces shorter than this are copied into the staging buffer; longer ones are shared. Small
/// frames (a 4 KiB write's is one piece of about 4.2 KiB) thus go out from one buffer as
/// before; only the data of a large write, or of a large read reply, is a piece of its own.
const COPY_BYTES_MAX: usize = 16 * 1024;
/// Once this much is queued, the writer should write it before taking more frames.
const QUEUED_BYTES_MAX: usize = 256 * 1024;
/// ... or once this many pieces are (well below `IOV_MAX`, 1024 on Linux).
const QUEUED_PIECES_MAX: usize = 256;
/// Room the staging buffer is given at a time.
const STAGING_BYTES: usize = 64 * 1024;

/// Bytes waiting to be written to one connection, in order.
#[derive(Default)]
pub struct Outgoing {
    /// Small pieces not yet cut off into `pieces`.
    staging: BytesMut,
    /// Everything queued before `staging`'s bytes, in order.
    pieces: Vec<Bytes>,
    queued_bytes: usize,
}

impl Outgoing {
    pub fn new() -> Outgoing {
        Outgoing::default()
    }

    /// Queue a piece of a frame: copied if small, shared if not.
    pub fn push(&mut self, piece: &Bytes) {
        if piece.len() < COPY_BYTES_MAX {
            self.push_copy(piece);
        } else {
            self.cut();
            self.pieces.push(piece.clone());
            self.queued_bytes += piece.len();
        }
    }

    /// Queue a frame encoded into `buf`, a buffer its writer keeps between frames: copied if
    /// small; if not, its bytes are taken over and `buf` gets new room of that size for the next.
    pub fn push_encoded(&mut self, buf: &mut BytesMut) {
        let encoded = buf.len();
        if encoded < COPY_BYTES_MAX {
            self.push_copy(buf);
            buf.clear();
        } else {
            self.push(&buf.split().freeze());
            buf.reserve(encoded);
        }
    }

    fn push_copy(&mut self, bytes: &[u8]) {
        self.staging_room(bytes.len()).extend_from_slice(bytes);
        self.queued_bytes += bytes.len();
    }

    /// Whether the writer should write what is queued before taking more.
    pub fn is_full(&self) -> bool {
        self.queued_bytes >= QUEUED_BYTES_MAX || self.pieces.len() >= QUEUED_PIECES_MAX
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.queued_bytes == 0
    }

    /// Write everything queued to `out` and flush it (TLS keeps records until flushed). With
    /// a `lender` (the same stream's), what is queued is lent to the socket instead of copied
    /// into it if any piece is at least `LEND_BYTES_MIN`: a large write's head, data and piece
    /// checksums then still leave together.
    pub async fn write_to<W: AsyncWrite + Unpin>(
        &mut self,
        out: &mut W,
        lender: Option<&mut Lender>,
    ) -> std::io::Result<()> {
        self.cut();
        match lender {
            Some(lender) if self.pieces.iter().any(|piece| piece.len() >= LEND_BYTES_MIN) => {
                lender.lend(&self.pieces).await?;
            }
            mut lender => {
                // Before the write: the socket then counts only what the peer has not read of
                // earlier messages (a message just written is counted at more than its length).
                if let Some(lender) = lender.as_deref_mut() {
                    lender.release()?;
                }
                let mut slices: Vec<IoSlice<'_>> = self.pieces.iter().map(|piece| IoSlice::new(piece)).collect();
                let mut left = &mut slices[..];
                while !left.is_empty() {
                    let written = out.write_vectored(left).await?;
                    if written == 0 {
                        return Err(std::io::ErrorKind::WriteZero.into());
                    }
                    if let Some(lender) = lender.as_deref_mut() {
                        lender.wrote(written);
                    }
                    IoSlice::advance_slices(&mut left, written);
                }
            }
        }
        self.pieces.clear();
        self.queued_bytes = 0;
        out.flush().await
    }

    /// The staging buffer with room for `bytes` more. Room is made in a new allocation when
    /// it runs out: the bytes staged before were cut off as a piece of their own.
    fn staging_room(&mut self, bytes: usize) -> &mut BytesMut {
        if self.staging.capacity() - self.staging.len() < bytes {
            self.cut();
            self.staging = BytesMut::with_capacity(bytes.max(STAGING_BYTES));
        }
        &mut self.staging
    }

    /// Move the staged bytes into `pieces` (the rest of the staging allocation stays for later
    /// pieces).
    fn cut(&mut self) {
        if !self.staging.is_empty() {
            self.pieces.push(self.staging.split().freeze());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        pin::Pin,
        task::{Context, Poll},
    };

    use super::*;

    /// A socket that takes at most `per_call` bytes a call (all of them if 0) and counts calls.
    struct Socket {
        received: Vec<u8>,
        per_call: usize,
        calls: usize,
        flushes: usize,
    }

    impl AsyncWrite for Socket {
        fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
            self.as_mut().poll_write_vectored(cx, &[IoSlice::new(buf)])
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<std::io::Result<usize>> {
            self.calls += 1;
            let mut budget = if self.per_call == 0 { usize::MAX } else { self.per_call };
            let mut taken = 0;
            for buf in bufs {
                let take = buf.len().min(budget);
                self.received.extend_from_slice(&buf[..take]);
                taken += take;
                budget -= take;
                if budget == 0 {
                    break;
                }
            }
            Poll::Ready(Ok(taken))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            self.flushes += 1;
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn bytes(length: usize, seed: u8) -> Bytes {
        (0..length).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect::<Vec<u8>>().into()
    }

    #[tokio::test]
    async fn a_large_frame_goes_out_in_one_call_with_its_head_and_tail() {
        let (head, data, tail) = (bytes(42, 1), bytes(1 << 20, 2), bytes(1028, 3));
        let mut outgoing = Outgoing::new();
        for piece in [&head, &data, &tail] {
            outgoing.push(piece);
        }
        assert!(!data.is_unique(), "the data is shared with the queue, not copied");
        assert!(outgoing.is_full(), "1 MiB queued asks to be written");
        let mut socket = Socket { received: Vec::new(), per_call: 0, calls: 0, flushes: 0 };
        outgoing.write_to(&mut socket, None).await.expect("write");
        assert_eq!(socket.calls, 1, "head, data and tail in one vectored write");
        assert_eq!(socket.flushes, 1);
        assert_eq!(socket.received, [&head[..], &data[..], &tail[..]].concat());
        assert!(outgoing.is_empty());
        assert!(data.is_unique(), "the queue keeps no reference once written");
    }

    #[tokio::test]
    async fn frames_come_out_in_order_however_the_socket_takes_them() {
        // Small pieces (staged), large pieces (shared) and encoded frames of both sizes, through
        // a socket that takes 1,000 bytes a call, over several rounds of the same queue.
        let mut expected = Vec::new();
        let mut outgoing = Outgoing::new();
        let mut socket = Socket { received: Vec::new(), per_call: 1000, calls: 0, flushes: 0 };
        for round in 0..3u8 {
            for i in 0..40usize {
                let piece = bytes(
                    [7, 100, 5000, COPY_BYTES_MAX - 1, COPY_BYTES_MAX, 70_000][i % 6],
                    round.wrapping_add(i as u8),
                );
                outgoing.push(&piece);
                expected.extend_from_slice(&piece);
                if i % 5 == 0 {
                    let encoded = bytes([300, 90_000][i % 2], 9);
                    let mut buf = BytesMut::from(&encoded[..]);
                    outgoing.push_encoded(&mut buf);
                    assert!(buf.is_empty(), "the writer's buffer is ready for the next frame");
                    expected.extend_from_slice(&encoded);
                }
                if outgoing.is_full() {
                    outgoing.write_to(&mut socket, None).await.expect("write");
                }
            }
            outgoing.write_to(&mut socket, None).await.expect("write");
            assert!(outgoing.is_empty());
        }
        assert_eq!(socket.received.len(), expected.len());
        assert!(socket.received == expected, "every byte in order");
    }

    #[tokio::test]
    async fn a_socket_that_takes_nothing_is_an_error() {
        struct Closed;
        impl AsyncWrite for Closed {
            fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, _: &[u8]) -> Poll<std::io::Result<usize>> {
                Poll::Ready(Ok(0))
            }
            fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
                Poll::Ready(Ok(()))
            }
            fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
                Poll::Ready(Ok(()))
            }
        }
        let mut outgoing = Outgoing::new();
        outgoing.push(&bytes(10, 0));
        let error = outgoing.write_to(&mut Closed, None).await.expect_err("nothing taken");
        assert_eq!(error.kind(), std::io::ErrorKind::WriteZero);
    }
}
