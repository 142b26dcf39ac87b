//! An in-process emulated WAN link: a TCP proxy that delays every byte by a fixed one-way
//! delay in each direction, preserving order. TCP between the proxy and its peers stays the
//! kernel's; the delay is added in user space (this machine has no netem).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Listen on `listen` and forward every connection to `target`, `one_way` later each way.
/// Returns the bound address (useful with port 0).
pub async fn start_delay_proxy(listen: SocketAddr, target: SocketAddr, one_way: Duration) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(listen).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((inbound, _)) = listener.accept().await else { continue };
            tokio::spawn(async move {
                let Ok(outbound) = TcpStream::connect(target).await else { return };
                let _ = inbound.set_nodelay(true);
                let _ = outbound.set_nodelay(true);
                let (in_read, in_write) = inbound.into_split();
                let (out_read, out_write) = outbound.into_split();
                tokio::select! {
                    _ = pump(in_read, out_write, one_way) => {}
                    _ = pump(out_read, in_write, one_way) => {}
                }
            });
        }
    });
    Ok(bound)
}

/// Copy one direction, holding each chunk until `delay` after it was read.
async fn pump(mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf, delay: Duration) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Bytes)>();
    let reader = async move {
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.send((Instant::now() + delay, Bytes::copy_from_slice(&buf[..n]))).is_err() {
                        return;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}
