//! The admin endpoint, an HTTP server (hyper, routed by axum) on the admin address:
//!
//! - `GET /`: the live status page (`status_page.rs`), fed by `GET /events` (server-sent
//!   events: the status document and the charts' samples, once a second);
//! - `GET /status` (JSON, the shape `starfish status --json` prints), `GET /metrics`
//!   (OpenMetrics text), `GET /volumes` (`starfish volume list`), `GET /snapshots`
//!   (`starfish snapshot list`);
//! - the orders: `POST /failover` (a standby takes over; `starfish failover`), `POST /drain`
//!   (the active host element drains and becomes a standby), `POST /scrub?volume=NAME[&rate=BYTES]`
//!   (`starfish scrub`), `POST /volumes/create?name=NAME&size=BYTES`,
//!   `POST /volumes/delete?name=NAME[&with_snapshots=1]`, `POST /volumes/resize?name=NAME&size=BYTES`
//!   and `POST /volumes/clone?snapshot=VOLUME@NAME&name=NEW` (`starfish volume …`), `POST /snapshots/create?volume=VOLUME&name=NAME` (or `?group=GROUP&name=NAME`) and
//!   `POST /snapshots/delete?snapshot=VOLUME@NAME` (`starfish snapshot …`).
//!
//! What a request asks for is read by the core (`starfish_core::admin_request`, fuzzed).
//! With TLS configured (`--tls-dir`) the same port also speaks HTTPS (told apart by the first
//! byte: a TLS handshake record). Orders that change the cluster (every POST) need HTTPS with
//! a client certificate of the `admin` role (`POST /drain` also takes a host element's: the
//! standby that takes over sends it); reads (`GET`) are answered to anyone on loopback, and
//! beyond it only over HTTPS to a certificate of the cluster.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Extension, State};
use axum::http::{header, HeaderValue, Method, Request, StatusCode, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{json, Value};
use starfish_core::HostStatus;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

use crate::node::Node;
use crate::status_page::{EVENT_STREAM_LIFETIME, PAGE_CSP, PAGE_HTML};
use crate::tls::{Identity, PeerCertificate, Role, Stream, TlsContext};

/// First byte of a TLS handshake record.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

use starfish_core::admin_request::{self, AdminRequest, REQUEST_BYTES_MAX};

/// Admin connections served at once; more are closed until one ends.
const CONNECTIONS_MAX: usize = 32;
/// A connection is answered within this (a takeover may wait 10 s for the old host element's
/// drain), else cut; but for the status page's feed, which ends by itself.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// A request's head must arrive within this.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections beyond [`CONNECTIONS_MAX`] told "503, try again" at once (more are closed).
const OVERFLOW_MAX: usize = 64;
/// How long a connection beyond the limit may take to send its request head.
const OVERFLOW_HEAD_TIMEOUT: Duration = Duration::from_secs(2);

/// What the server knows of the connection a request came on.
#[derive(Clone, Debug)]
struct Connection {
    caller: Caller,
    /// Set once the connection carries the status page's feed (a long answer).
    streaming: Arc<AtomicBool>,
}

pub async fn serve(listener: TcpListener, host: Arc<Node>, tls: Option<TlsContext>) {
    let permits = Arc::new(tokio::sync::Semaphore::new(CONNECTIONS_MAX));
    let overflow = Arc::new(tokio::sync::Semaphore::new(OVERFLOW_MAX));
    let router = axum::Router::new().fallback(answer).with_state(host);
    loop {
        let (stream, peer) = match crate::accept::accept(&listener, "admin").await {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::error!(%error, "admin: the listener failed; the admin address stops answering");
                return;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            match overflow.clone().try_acquire_owned() {
                Ok(permit) => {
                    tracing::warn!(%peer, limit = CONNECTIONS_MAX, "admin: connection limit reached; answered 503");
                    tokio::spawn(async move {
                        answer_busy(stream).await;
                        drop(permit);
                    });
                }
                Err(_) => {
                    tracing::warn!(%peer, limit = CONNECTIONS_MAX, "admin: connection limit reached; connection closed")
                }
            }
            continue;
        };
        let router = router.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let authenticated = tokio::time::timeout(ANSWER_TIMEOUT, authenticate(stream, peer, tls.as_ref())).await;
            let (stream, caller) = match authenticated {
                Ok(Ok(authenticated)) => authenticated,
                Ok(Err(reason)) => {
                    tracing::warn!(%peer, "admin: connection refused: {reason}");
                    return;
                }
                Err(_) => return,
            };
            let streaming = Arc::new(AtomicBool::new(false));
            let connection = Connection { caller, streaming: streaming.clone() };
            let service = hyper::service::service_fn(move |mut request: Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(connection.clone());
                router.clone().oneshot(request)
            });
            let mut http = hyper::server::conn::http1::Builder::new();
            http.keep_alive(false).timer(TokioTimer::new()).header_read_timeout(HEAD_TIMEOUT);
            http.max_buf_size(REQUEST_BYTES_MAX);
            let served = http.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(served);
            let result = match tokio::time::timeout(ANSWER_TIMEOUT, served.as_mut()).await {
                Ok(result) => result,
                Err(_) if streaming.load(Ordering::Relaxed) => {
                    tokio::time::timeout(EVENT_STREAM_LIFETIME, served).await.unwrap_or(Ok(()))
                }
                Err(_) => Ok(()),
            };
            if let Err(error) = result {
                tracing::debug!(%peer, %error, "admin: connection ended with an error");
            }
            drop(permit);
        });
    }
}

/// A connection beyond the limit: its request head is read (so that closing does not reset
/// the answer away), then a 503 with `Retry-After` is written in the clear. A TLS client
/// cannot read that: it is closed.
async fn answer_busy(mut stream: TcpStream) {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let read_head = async {
        loop {
            let n = stream.read(&mut buf).await?;
            if n == 0 || buf[0] == TLS_HANDSHAKE_RECORD && head.is_empty() {
                return Ok::<bool, std::io::Error>(false);
            }
            head.extend_from_slice(&buf[..n]);
            if admin_request::head_complete(&head) {
                return Ok(true);
            }
            if head.len() >= REQUEST_BYTES_MAX {
                return Ok(false);
            }
        }
    };
    if !matches!(tokio::time::timeout(OVERFLOW_HEAD_TIMEOUT, read_head).await, Ok(Ok(true))) {
        return;
    }
    let body = format!("the admin address is answering {CONNECTIONS_MAX} connections; try again\n");
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(OVERFLOW_HEAD_TIMEOUT, stream.write_all(answer.as_bytes())).await;
    let _ = stream.shutdown().await;
}

/// Who is asking: with TLS configured, what its certificate says.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Caller {
    /// No TLS configured: trusted as before (the port is loopback-only, or `--insecure`).
    Anyone,
    /// TLS configured, but this request came in the clear from loopback: reads only.
    PlainLoopback,
    /// Over TLS, with the certificate's identity if one was presented.
    Tls { identity: Option<Identity>, loopback: bool },
}

impl Caller {
    /// Why this caller may not give an order (`drain`: the order a standby gives its peer).
    fn order_refusal(&self, drain: bool) -> Option<String> {
        match self {
            Caller::Anyone => None,
            Caller::PlainLoopback => Some("orders need HTTPS with an admin certificate (--tls-dir)".into()),
            Caller::Tls { identity: None, .. } => Some("orders need a client certificate of the admin role".into()),
            Caller::Tls { identity: Some(identity), .. } => match identity.role {
                Role::Admin => None,
                Role::Host if drain => None,
                _ => Some(format!("{identity} may not give orders; an admin certificate may")),
            },
        }
    }

    /// Why this caller may not read status or metrics: beyond loopback, only a member of the
    /// cluster (any certificate of its CA) may.
    fn read_refusal(&self) -> Option<String> {
        match self {
            Caller::Tls { identity: None, loopback: false } => {
                Some("status beyond loopback needs a certificate of the cluster (--tls-dir)".into())
            }
            _ => None,
        }
    }
}

async fn authenticate(
    stream: TcpStream,
    peer: std::net::SocketAddr,
    tls: Option<&TlsContext>,
) -> Result<(Stream, Caller), String> {
    let Some(tls) = tls else { return Ok((Stream::Plain(stream), Caller::Anyone)) };
    let mut first = [0u8; 1];
    let peeked = tokio::time::timeout(crate::tls::HANDSHAKE_TIMEOUT, stream.peek(&mut first))
        .await
        .map_err(|_| "sent nothing".to_string())?
        .map_err(|e| e.to_string())?;
    if peeked == 1 && first[0] == TLS_HANDSHAKE_RECORD {
        let (stream, identity) = tls.accept(stream, PeerCertificate::Optional).await?;
        return Ok((stream, Caller::Tls { identity, loopback: peer.ip().is_loopback() }));
    }
    if !peer.ip().is_loopback() {
        return Err("plain HTTP from beyond loopback; use HTTPS".into());
    }
    Ok((Stream::Plain(stream), Caller::PlainLoopback))
}

fn reply(code: StatusCode, content_type: &'static str, body: String) -> Response {
    (code, [(header::CONTENT_TYPE, content_type)], body).into_response()
}

fn json_reply(code: StatusCode, doc: Value) -> Response {
    reply(code, "application/json", doc.to_string())
}

async fn answer(
    State(host): State<Arc<Node>>,
    Extension(connection): Extension<Connection>,
    method: Method,
    uri: Uri,
) -> Response {
    let request = admin_request::classify(method.as_str(), uri.path_and_query().map_or("/", |p| p.as_str()));
    let caller = &connection.caller;
    let order = |result: Result<Value, String>| match result {
        Ok(doc) => json_reply(StatusCode::OK, doc),
        Err(e) => json_reply(StatusCode::CONFLICT, json!({ "error": e })),
    };
    let refusal = if request.is_order() {
        caller.order_refusal(request == AdminRequest::Drain)
    } else if request.is_read() {
        caller.read_refusal()
    } else {
        None
    };
    if let Some(reason) = refusal {
        tracing::warn!(?caller, ?request, "admin: refused: {reason}");
        return json_reply(StatusCode::FORBIDDEN, json!({ "error": reason }));
    }
    let stopping = || reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "host element stopping\n".into());
    match request {
        AdminRequest::StatusPage => {
            let mut page = reply(StatusCode::OK, "text/html; charset=utf-8", PAGE_HTML.into());
            let headers = page.headers_mut();
            headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(PAGE_CSP));
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
            page
        }
        AdminRequest::Events => events(&host, &connection.streaming),
        AdminRequest::Status => match host.status_json().await {
            Some(doc) => json_reply(StatusCode::OK, doc),
            None => stopping(),
        },
        AdminRequest::Metrics => match host.metrics().await {
            Some(text) => reply(StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", text),
            None => stopping(),
        },
        AdminRequest::Failover => order(host.take_over("told to (starfish failover)", true).await),
        AdminRequest::Drain => order(host.drain().await),
        AdminRequest::Scrub { volume, rate_bytes_per_s } => order(host.scrub(&volume, rate_bytes_per_s).await),
        AdminRequest::VolumeCreate { name, size_bytes, group } => {
            order(host.volume_create(&name, size_bytes, group).await)
        }
        AdminRequest::VolumeDelete { name, with_snapshots } => order(host.volume_delete(&name, with_snapshots).await),
        AdminRequest::VolumeResize { name, size_bytes, shrink } => {
            order(host.volume_resize(&name, size_bytes, shrink).await)
        }
        AdminRequest::VolumeClone { volume, snapshot, name } => {
            order(host.volume_clone(&format!("{volume}@{snapshot}"), &name).await)
        }
        AdminRequest::VolumeList => order(host.volume_list().await),
        AdminRequest::SnapshotCreate { volume, name, group } => {
            order(host.snapshot_create(&volume, &name, group).await)
        }
        AdminRequest::SnapshotDelete { volume, name } => order(host.snapshot_delete(&volume, &name).await),
        AdminRequest::SnapshotList => order(host.snapshot_list().await),
        AdminRequest::NotFound => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "try GET / (the status page), GET /status, GET /metrics, GET /volumes, GET /snapshots, POST /failover, POST /drain, POST /scrub?volume=NAME, POST /volumes/create?name=NAME&size=BYTES, POST /volumes/resize?name=NAME&size=BYTES[&shrink=1], POST /volumes/delete?name=NAME[&with_snapshots=1], POST /volumes/clone?snapshot=VOLUME@NAME&name=NEW, POST /snapshots/create?volume=VOLUME&name=NAME (or ?group=GROUP&name=NAME) or POST /snapshots/delete?snapshot=VOLUME@NAME\n".into(),
        ),
        AdminRequest::Malformed(why) => reply(StatusCode::BAD_REQUEST, "text/plain", format!("{why}\n")),
    }
}

/// The status page's feed: the samples kept (`history`), then each new status and sample
/// (`update`) until [`EVENT_STREAM_LIFETIME`]; the browser then reconnects by itself.
fn events(host: &Node, streaming: &AtomicBool) -> Response {
    let feed = host.feed();
    let Ok(permit) = feed.streams.clone().try_acquire_owned() else {
        let why = "too many status pages are following this host element; close one";
        return reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", format!("{why}\n"));
    };
    streaming.store(true, Ordering::Relaxed);
    let history = Event::default().event("history").retry(Duration::from_secs(1)).data(feed.history_json());
    let mut updates = feed.subscribe();
    // The newest update at once, then each one as it comes.
    updates.mark_changed();
    let deadline = tokio::time::Instant::now() + EVENT_STREAM_LIFETIME;
    let following = futures_util::stream::unfold((updates, permit), move |(mut updates, permit)| async move {
        loop {
            tokio::time::timeout_at(deadline, updates.changed()).await.ok()?.ok()?;
            let update = updates.borrow_and_update().clone();
            if let Some(update) = update {
                let event = Event::default().event("update").data(&*update);
                return Some((event, (updates, permit)));
            }
        }
    });
    let stream = futures_util::stream::once(async { history }).chain(following).map(Ok::<_, std::convert::Infallible>);
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

/// A volume's running (else last) scrub, in the status document.
fn scrub_json(s: &starfish_core::ScrubStatus) -> Value {
    let f = &s.findings;
    json!({
        "id": s.id,
        "running": s.running,
        "reason": s.reason.as_str(),
        "done_bytes": s.done_bytes,
        "total_bytes": s.total_bytes,
        "rate_bytes_per_s": s.rate_bytes_per_s,
        "elapsed_ms": s.elapsed_ms,
        "blocks_compared": f.blocks_compared,
        "blocks_changed": f.blocks_changed,
        "blocks_mismatched": f.blocks_mismatched,
        "blocks_undecided": f.blocks_undecided,
        "element_errors": f.element_errors,
        "last_error": f.last_error,
        "repaired": f.repaired,
    })
}

/// A volume's `beginning` in the status document: `null`, or the record fewer than Q hold.
pub fn beginning_json(beginning: Option<starfish_core::BeginningStatus>) -> Value {
    beginning.map_or(Value::Null, |b| {
        json!({
            "sequence": b.sequence.0,
            "held_by": b.held_by,
            "reads_wait": b.reads_wait,
            "reads_held": b.reads_held,
        })
    })
}

/// The status document; field names are part of the CLI contract (`starfish status --json`).
/// `exports`: the volumes exported over NBD (`HostConfig::exported`, never empty); a
/// consistency group's member is reported with its group's state (mode, sequences, write
/// queue, scrubs: they are the group's), and the groups are listed under `groups`.
pub fn status_json(
    status: &HostStatus,
    addresses: &[String],
    links: &[String],
    exports: &[starfish_core::groups::ExportedVolume],
    clients: &std::collections::HashMap<String, usize>,
) -> Value {
    let storage: Vec<Value> = status
        .volumes
        .iter()
        .map(|v| {
            json!({
                "name": v.name,
                "size_bytes": v.size_bytes,
                "mode": v.mode.as_str(),
                "acked_sequence": v.acked_sequence.0,
                "last_sequence": v.last_sequence.0,
                "write_queue_used_bytes": v.write_queue_used_bytes,
                "write_queue_capacity_bytes": v.write_queue_capacity_bytes,
                "write_queue_oldest_sequence": v.write_queue_oldest.map(|s| s.0),
                "writes_waiting": v.writes_waiting,
                "scrub": v.scrubs.last().map(scrub_json),
                "scrubs": v.scrubs.iter().map(scrub_json).collect::<Vec<_>>(),
                "beginning": beginning_json(v.beginning),
            })
        })
        .collect();
    let volumes: Vec<Value> = exports
        .iter()
        .filter_map(|e| {
            let mut o = storage.get(e.volume)?.clone();
            o["name"] = json!(e.name);
            o["size_bytes"] = json!(e.size_bytes);
            o["nbd_connections"] = json!(clients.get(&e.name).copied().unwrap_or(0));
            if let Some(group) = &e.group {
                o["group"] = json!(group);
                o["group_offset_bytes"] = json!(e.offset_bytes);
            }
            Some(o)
        })
        .collect();
    let groups: Vec<Value> = status
        .volumes
        .iter()
        .enumerate()
        .filter(|(i, _)| exports.iter().any(|e| e.volume == *i && e.group.is_some()))
        .map(|(i, v)| {
            let members: Vec<&starfish_core::groups::ExportedVolume> =
                exports.iter().filter(|e| e.volume == i).collect();
            json!({
                "name": members.first().and_then(|e| e.group.clone()),
                "storage_volume": v.name,
                "size_bytes": v.size_bytes,
                "mode": v.mode.as_str(),
                "acked_sequence": v.acked_sequence.0,
                "volumes": members.iter().map(|e| e.name.clone()).collect::<Vec<_>>(),
            })
        })
        .collect();
    let elements: Vec<Value> = status
        .elements
        .iter()
        .enumerate()
        .map(|(i, e)| {
            // The catalog's storage volume is reported under `catalog`, not among the volumes.
            let applied: serde_json::Map<String, Value> = status
                .volumes
                .iter()
                .zip(&e.applied_sequence)
                // Removed volumes are placeholders of size 0: not reported.
                .filter(|(v, _)| v.name != starfish_core::catalog::CATALOG_VOLUME && v.size_bytes > 0)
                .map(|(v, s)| (v.name.clone(), json!(s.0)))
                .collect();
            let mut o = json!({
                "name": e.name,
                "address": addresses.get(i),
                "link": links.get(i).map_or("tcp", |l| l.as_str()),
                "state": e.state,
                "ack_policy": e.ack_policy.as_str(),
                "applied_sequence": applied,
                "lag": e.lag,
                "rtt_ms": e.rtt_us.map(|us| us as f64 / 1000.0),
                "reads": {
                    "out_bytes": e.reads_out_bytes,
                    "window_bytes": e.read_window_bytes,
                    "rate_bytes_per_s": e.read_rate_bytes_per_s,
                },
            });
            if let Some(reason) = &e.reason {
                o["reason"] = json!(reason);
            }
            if let Some(r) = &e.recovery {
                let seconds = r.elapsed_us as f64 / 1e6;
                let mut recovery = json!({
                    "kind": r.kind.as_str(),
                    "source": r.source.as_deref().unwrap_or("host element write queue"),
                    "done_records": r.done_records,
                    "total_records": r.total_records,
                    "seconds": seconds,
                });
                if !r.waiting_for_source.is_empty() {
                    recovery["waiting_for_source"] = json!(r.waiting_for_source);
                }
                match (r.copy_done_bytes, r.copy_total_bytes) {
                    // A block copy: progress in bytes of volume compared.
                    (Some(done), Some(total)) => {
                        let rate = if seconds > 0.0 { done as f64 / seconds } else { 0.0 };
                        recovery["phase"] = json!("copy");
                        recovery["done_bytes"] = json!(done);
                        recovery["total_bytes"] = json!(total);
                        recovery["copied_bytes"] = json!(r.copied_bytes.unwrap_or(0));
                        recovery["bytes_per_second"] = json!(rate);
                        recovery["eta_seconds"] = json!((rate > 0.0).then(|| total.saturating_sub(done) as f64 / rate));
                    }
                    _ => {
                        let rate = if seconds > 0.0 { r.done_records as f64 / seconds } else { 0.0 };
                        recovery["phase"] = json!("replay");
                        recovery["records_per_second"] = json!(rate);
                        recovery["eta_seconds"] =
                            json!((rate > 0.0).then(|| r.total_records.saturating_sub(r.done_records) as f64 / rate));
                    }
                }
                o["recovery"] = recovery;
            }
            if let Some(r) = &e.last_recovery {
                o["last_recovery"] = json!({
                    "kind": r.kind.as_str(),
                    "records": r.records,
                    "copied_bytes": r.copied_bytes,
                    "seconds": r.seconds,
                });
            }
            o
        })
        .collect();
    let catalog = status.volumes.iter().position(|v| v.name == starfish_core::catalog::CATALOG_VOLUME);
    let catalog = catalog.map(|i| {
        let mut o = storage[i].clone();
        o["applied_sequence"] = status
            .elements
            .iter()
            .map(|e| (e.name.clone(), json!(e.applied_sequence.get(i).map_or(0, |s| s.0))))
            .collect::<serde_json::Map<String, Value>>()
            .into();
        o
    });
    json!({
        "epoch": status.epoch.0,
        "quorum": status.quorum,
        "ready": status.ready,
        "volumes": volumes,
        "groups": groups,
        "catalog": catalog,
        "elements": elements,
        "read_cache": {
            "used_bytes": status.read_cache_used_bytes,
            "hits": status.read_cache_hits,
            "misses": status.read_cache_misses,
            "declined": status.read_cache_declined,
        },
        "reads_waiting": {
            "count": status.reads_waiting,
            "bytes": status.reads_waiting_bytes,
        },
    })
}

/// Fetch `path` from an admin endpoint (used by `starfish status`).
pub async fn get(admin: std::net::SocketAddr, path: &str, tls: Option<&TlsContext>) -> std::io::Result<String> {
    request(admin, "GET", path, tls).await
}

/// One request to an admin endpoint (over HTTPS with `tls`, presenting its certificate); the
/// body of a 200 answer, else an error with the status line and body.
pub async fn request(
    admin: std::net::SocketAddr,
    method: &str,
    path: &str,
    tls: Option<&TlsContext>,
) -> std::io::Result<String> {
    let stream = crate::tls::connect(admin, tls, &[Role::Host], std::time::Duration::from_secs(5))
        .await
        .map_err(std::io::Error::other)?;
    exchange(stream, admin, method, path).await
}

async fn exchange(
    mut stream: impl AsyncRead + AsyncWrite + Unpin,
    admin: std::net::SocketAddr,
    method: &str,
    path: &str,
) -> std::io::Result<String> {
    let head = format!("{method} {path} HTTP/1.0\r\nHost: {admin}\r\nContent-Length: 0\r\n\r\n");
    stream.write_all(head.as_bytes()).await?;
    stream.flush().await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    if head.split(' ').nth(1) != Some("200") {
        let status = head.lines().next().unwrap_or("");
        return Err(std::io::Error::other(format!("admin endpoint answered: {status}: {}", body.trim())));
    }
    Ok(body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn who_may_read_and_who_may_give_orders() {
        let tls = |role: Option<Role>, loopback| Caller::Tls {
            identity: role.map(|role| Identity { role, name: "x".into() }),
            loopback,
        };
        // Orders: an operator; a drain also from a host element (the standby taking over).
        assert_eq!(tls(Some(Role::Admin), false).order_refusal(false), None);
        assert_eq!(tls(Some(Role::Host), false).order_refusal(true), None);
        assert!(tls(Some(Role::Host), false).order_refusal(false).is_some());
        for caller in
            [tls(Some(Role::Client), true), tls(Some(Role::Element), true), tls(None, true), Caller::PlainLoopback]
        {
            assert!(caller.order_refusal(true).is_some(), "{caller:?}");
        }
        assert_eq!(Caller::Anyone.order_refusal(false), None);
        // Reads: anyone on loopback, any member of the cluster beyond it.
        assert_eq!(tls(None, true).read_refusal(), None);
        assert_eq!(tls(Some(Role::Client), false).read_refusal(), None);
        assert_eq!(Caller::PlainLoopback.read_refusal(), None);
        assert!(tls(None, false).read_refusal().is_some());
    }
}
