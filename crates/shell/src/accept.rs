//! One way to accept connections for every listener (element, NBD, admin): an error that
//! concerns one connection or a passing shortage (file descriptors, memory) is logged and
//! retried after a pause, never a busy loop and never the end of the process; an error that
//! means the listener itself is broken is returned.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

/// Pause after a failed accept before accepting again.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

pub(crate) async fn accept(listener: &TcpListener, what: &str) -> io::Result<(TcpStream, SocketAddr)> {
    loop {
        match listener.accept().await {
            Ok(accepted) => return Ok(accepted),
            Err(error) if is_transient(&error) => {
                tracing::warn!(%error, "{what}: accept failed; retrying in {ACCEPT_ERROR_PAUSE:?}");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
            }
            Err(error) => return Err(error),
        }
    }
}

fn is_transient(error: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        error.kind(),
        ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted | WouldBlock | TimedOut
    ) || matches!(
        error.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM | libc::EPROTO | libc::EPERM)
    )
}
