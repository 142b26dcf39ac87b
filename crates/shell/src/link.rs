//! An emulated WAN link: a TCP proxy that delays every byte by a fixed one-way delay in each
//! direction, preserving order. TCP between the proxy and its peers stays the kernel's; the
//! delay is added in user space (this machine has no netem). Each direction runs on its own
//! pair of threads so the delay is held with the OS timer's precision (tens of µs), not the
//! async runtime's millisecond timer wheel.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Bytes read at once; one chunk is delayed as a unit.
const CHUNK_BYTES: usize = 256 * 1024;

/// Listen on `listen` and forward every connection to `target`, `one_way` later each way.
/// Returns the bound address (useful with port 0).
pub async fn start_delay_proxy(listen: SocketAddr, target: SocketAddr, one_way: Duration) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(listen)?;
    let bound = listener.local_addr()?;
    std::thread::Builder::new().name(format!("link-{bound}")).spawn(move || {
        for inbound in listener.incoming() {
            let Ok(inbound) = inbound else { continue };
            let Ok(outbound) = TcpStream::connect(target) else {
                let _ = inbound.shutdown(Shutdown::Both);
                continue;
            };
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            for (from, to) in [(&inbound, &outbound), (&outbound, &inbound)] {
                if let (Ok(from), Ok(to)) = (from.try_clone(), to.try_clone()) {
                    spawn_direction(from, to, one_way);
                }
            }
        }
    })?;
    Ok(bound)
}

fn spawn_direction(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let mut closer = to.try_clone().ok();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = from.shutdown(Shutdown::Read);
    });
    std::thread::spawn(move || {
        while let Ok((due, chunk)) = rx.recv() {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        if let Some(c) = closer.take() {
            let _ = c.shutdown(Shutdown::Both);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn delays_each_direction_and_keeps_order() {
        let server = TcpListener::bind("127.0.0.1:0").expect("bind");
        let server_addr = server.local_addr().expect("addr");
        std::thread::spawn(move || {
            let (mut s, _) = server.accept().expect("accept");
            let mut buf = [0u8; 1024];
            loop {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => s.write_all(&buf[..n]).expect("echo"),
                }
            }
        });
        let one_way = Duration::from_millis(20);
        let proxy = start_delay_proxy("127.0.0.1:0".parse().unwrap(), server_addr, one_way).await.expect("proxy");
        let mut c = TcpStream::connect(proxy).expect("connect");
        c.set_nodelay(true).unwrap();
        for round in 0..5u8 {
            let start = Instant::now();
            c.write_all(&[round; 100]).unwrap();
            let mut got = [0u8; 100];
            c.read_exact(&mut got).unwrap();
            let rtt = start.elapsed();
            assert_eq!(got, [round; 100], "bytes arrive intact and in order");
            assert!(rtt >= 2 * one_way, "round trip {rtt:?} shorter than two one-way delays");
        }
    }
}
