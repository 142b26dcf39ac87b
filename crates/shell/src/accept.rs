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

/// While accepting keeps failing, the failure is logged again at most this often.
const ACCEPT_ERROR_LOG_EVERY: Duration = Duration::from_secs(60);

/// When a failed accept was last logged, by any listener of the process.
static LOGGED_AT: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);

/// The next connection. A passing failure (out of file descriptors, say) is logged at most
/// once a minute for the whole process, with a count, and accepting going on again once.
pub(crate) async fn accept(listener: &TcpListener, what: &str) -> io::Result<(TcpStream, SocketAddr)> {
    accept_with(|| listener.accept(), what).await
}

/// [`accept`] for any listener: `next` accepts one connection.
pub(crate) async fn accept_with<T, F, Fut>(mut next: F, what: &str) -> io::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = io::Result<T>>,
{
    let mut failures = 0u64;
    loop {
        match next().await {
            Ok(accepted) => {
                if failures > 0 {
                    tracing::debug!(failures, "{what}: accepting connections again");
                }
                return Ok(accepted);
            }
            Err(error) if is_transient(&error) => {
                failures += 1;
                let log = {
                    let mut logged_at = LOGGED_AT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                    let due = logged_at.is_none_or(|at| at.elapsed() >= ACCEPT_ERROR_LOG_EVERY);
                    if due {
                        *logged_at = Some(std::time::Instant::now());
                    }
                    due
                };
                if log {
                    tracing::warn!(
                        %error,
                        failures,
                        "{what}: accept failed; retrying every {ACCEPT_ERROR_PAUSE:?} (connections wait meanwhile)"
                    );
                }
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
