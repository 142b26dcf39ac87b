//! Helpers shared by the integration tests: an echo server, a checked bulk transfer, bounded
//! waits. Every socket gets a timeout, so a broken link fails a test instead of hanging it.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest a test waits for a peer.
pub const TIMEOUT: Duration = Duration::from_secs(20);

/// Accepts `connections` connections and echoes each until it closes.
pub fn echo_server(listener: TcpListener, connections: usize) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut threads = Vec::new();
        for _ in 0..connections {
            let Ok(mut stream) = netem::measure::accept_within(&listener, TIMEOUT) else {
                break;
            };
            threads.push(std::thread::spawn(move || {
                let _ = stream.set_nodelay(true);
                let _ = stream.set_read_timeout(Some(TIMEOUT));
                let mut buf = [0u8; 16 * 1024];
                while let Ok(n @ 1..) = netem::measure::read_some(&mut stream, &mut buf) {
                    if stream.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            }));
        }
        for thread in threads {
            let _ = thread.join();
        }
    })
}

/// Accepts one connection and reads it to the end; returns the bytes and when the last arrived.
pub fn sink_server(listener: TcpListener) -> JoinHandle<(Vec<u8>, Instant)> {
    std::thread::spawn(move || {
        let mut stream = netem::measure::accept_within(&listener, TIMEOUT).expect("the client connects");
        stream.set_read_timeout(Some(TIMEOUT)).expect("timeout");
        let mut received = Vec::new();
        let mut buf = vec![0u8; 256 * 1024];
        let mut last = Instant::now();
        loop {
            let n = netem::measure::read_some(&mut stream, &mut buf).expect("the transfer completes");
            if n == 0 {
                break;
            }
            last = Instant::now();
            received.extend_from_slice(&buf[..n]);
        }
        (received, last)
    })
}

/// Deterministic, non-repeating-looking test data.
pub fn data(len: usize) -> Vec<u8> {
    let mut x: u32 = 0x1234_5678;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// Writes everything, half-closes, and returns the moment before the first write.
pub fn send_all(stream: &mut TcpStream, bytes: &[u8]) -> Instant {
    stream.set_write_timeout(Some(TIMEOUT)).expect("timeout");
    let start = Instant::now();
    stream.write_all(bytes).expect("the link takes the data");
    stream.shutdown(Shutdown::Write).expect("half-close");
    start
}

/// Sends `message` and waits for its echo; returns the round trip.
pub fn ping(stream: &mut TcpStream, message: &[u8]) -> Duration {
    stream.set_nodelay(true).expect("nodelay");
    stream.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    let start = Instant::now();
    stream.write_all(message).expect("write");
    let mut echo = vec![0u8; message.len()];
    stream.read_exact(&mut echo).expect("the echo arrives");
    let rtt = start.elapsed();
    assert_eq!(echo, message, "the echo is the message");
    rtt
}

/// Whether anything arrives within `wait` (without consuming it).
pub fn arrives_within(stream: &mut TcpStream, wait: Duration) -> bool {
    use std::io::ErrorKind::{Interrupted, TimedOut, WouldBlock};
    let deadline = Instant::now() + wait;
    let mut byte = [0u8; 1];
    let arrived = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break false;
        }
        stream.set_read_timeout(Some(left)).expect("timeout");
        match stream.peek(&mut byte) {
            Ok(n) => break n > 0,
            Err(e) if matches!(e.kind(), WouldBlock | TimedOut) => break false,
            // A socket with a timeout returns EINTR on any signal, even a stop and continue.
            Err(e) if e.kind() == Interrupted => continue,
            Err(e) => panic!("the connection failed: {e}"),
        }
    };
    stream.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    arrived
}
