//! The admin endpoint's requests: what a request's method and target ask for, once the
//! shell's HTTP server (hyper, through axum) has read it. Sans-IO, bounded, and fuzzed
//! (`fuzz/fuzz_targets/admin_request.rs`, through [`parse`] of a whole request head).

/// A request head longer than this is refused: the admin API takes short requests only.
pub const REQUEST_BYTES_MAX: usize = 8192;

/// What a request asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdminRequest {
    /// `GET /`: the live status page (HTML).
    StatusPage,
    /// `GET /events`: the status page's feed (server-sent events).
    Events,
    /// `GET /status`: the status document.
    Status,
    /// `GET /metrics`: Prometheus text.
    Metrics,
    /// `POST /failover`: this standby takes over.
    Failover,
    /// `POST /drain`: this active host element drains and turns standby.
    Drain,
    /// `POST /scrub?volume=NAME[&rate=BYTES]`: scrub a volume (rate 0: unlimited; none: the
    /// host element's configured scrub rate).
    Scrub { volume: String, rate_bytes_per_s: Option<u64> },
    /// `POST /volumes/create?name=NAME&size=BYTES[&group=GROUP]`: create a volume, joining
    /// consistency group `group` if given (`starfish volume create [--group GROUP]`).
    VolumeCreate { name: String, size_bytes: u64, group: Option<String> },
    /// `POST /volumes/delete?name=NAME[&with_snapshots=1]`: delete a volume created while
    /// running, with its snapshots if asked (`starfish volume delete [--with-snapshots]`).
    VolumeDelete { name: String, with_snapshots: bool },
    /// `POST /volumes/resize?name=NAME&size=BYTES[&shrink=1]`: resize a volume created while
    /// running (`starfish volume resize [--shrink]`).
    VolumeResize { name: String, size_bytes: u64, shrink: bool },
    /// `POST /volumes/clone?snapshot=VOLUME@NAME&name=NEW`: create volume `name` as a clone
    /// of a snapshot (`starfish volume clone VOLUME@NAME NEW`).
    VolumeClone { volume: String, snapshot: String, name: String },
    /// `GET /volumes`: every volume served (`starfish volume list`).
    VolumeList,
    /// `POST /snapshots/create?volume=VOLUME&name=NAME`: take a snapshot (`starfish snapshot
    /// create VOLUME NAME`); `?group=GROUP&name=NAME`: of a consistency group, all its volumes
    /// at one point (`starfish snapshot create --group GROUP NAME`; `group` is then set).
    SnapshotCreate { volume: String, name: String, group: bool },
    /// `POST /snapshots/delete?snapshot=VOLUME@NAME`: delete a snapshot (`starfish snapshot
    /// delete VOLUME@NAME`).
    SnapshotDelete { volume: String, name: String },
    /// `GET /snapshots`: every snapshot (`starfish snapshot list`).
    SnapshotList,
    /// A well-formed request for something else.
    NotFound,
    /// Not an HTTP/1 request line (the reason says why).
    Malformed(&'static str),
}

impl AdminRequest {
    /// Whether it changes the cluster (and so needs an operator's certificate under TLS).
    pub fn is_order(&self) -> bool {
        matches!(
            self,
            AdminRequest::Failover
                | AdminRequest::Drain
                | AdminRequest::Scrub { .. }
                | AdminRequest::VolumeCreate { .. }
                | AdminRequest::VolumeDelete { .. }
                | AdminRequest::VolumeResize { .. }
                | AdminRequest::VolumeClone { .. }
                | AdminRequest::SnapshotCreate { .. }
                | AdminRequest::SnapshotDelete { .. }
        )
    }

    /// Whether it reads the cluster's state (and so needs, beyond loopback, a certificate of
    /// the cluster under TLS).
    pub fn is_read(&self) -> bool {
        matches!(
            self,
            AdminRequest::StatusPage
                | AdminRequest::Events
                | AdminRequest::Status
                | AdminRequest::Metrics
                | AdminRequest::VolumeList
                | AdminRequest::SnapshotList
        )
    }
}

/// Whether `received` holds a whole request head (through the blank line): what the admin
/// address reads of a connection it answers 503 without serving.
pub fn head_complete(received: &[u8]) -> bool {
    received.windows(4).any(|w| w == b"\r\n\r\n") || received.windows(2).any(|w| w == b"\n\n")
}

/// The request a head asks for, from its request line (`METHOD TARGET HTTP/1.x`); headers and
/// a query string are ignored.
pub fn parse(head: &[u8]) -> AdminRequest {
    let head = &head[..head.len().min(REQUEST_BYTES_MAX)];
    let line_end = head.iter().position(|&b| b == b'\n').unwrap_or(head.len());
    let Ok(line) = std::str::from_utf8(&head[..line_end]) else {
        return AdminRequest::Malformed("the request line is not UTF-8");
    };
    let line = line.strip_suffix('\r').unwrap_or(line);
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return AdminRequest::Malformed("expected METHOD TARGET HTTP/1.x");
    };
    if !version.starts_with("HTTP/1.") || method.is_empty() || !target.starts_with('/') {
        return AdminRequest::Malformed("expected METHOD TARGET HTTP/1.x");
    }
    classify(method, target)
}

/// The request a method and target (`/path?query`) ask for.
pub fn classify(method: &str, target: &str) -> AdminRequest {
    if target.len() > REQUEST_BYTES_MAX {
        return AdminRequest::Malformed("the request target is too long");
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    match (method, path) {
        ("GET", "/") => AdminRequest::StatusPage,
        ("GET", "/events") => AdminRequest::Events,
        ("GET", "/status") => AdminRequest::Status,
        ("GET", "/metrics") => AdminRequest::Metrics,
        ("POST", "/failover") => AdminRequest::Failover,
        ("POST", "/drain") => AdminRequest::Drain,
        ("POST", "/scrub") => scrub(query),
        ("POST", "/volumes/create") => volume_sized(query, "/volumes/create", |name, size_bytes, _, group| {
            AdminRequest::VolumeCreate { name, size_bytes, group }
        }),
        ("POST", "/volumes/resize") => volume_sized(query, "/volumes/resize", |name, size_bytes, shrink, _| {
            AdminRequest::VolumeResize { name, size_bytes, shrink }
        }),
        ("POST", "/volumes/delete") => volume_delete(query),
        ("POST", "/volumes/clone") => volume_clone(query),
        ("GET", "/volumes") => AdminRequest::VolumeList,
        ("POST", "/snapshots/create") => snapshot_create(query),
        ("POST", "/snapshots/delete") => snapshot_delete(query),
        ("GET", "/snapshots") => AdminRequest::SnapshotList,
        _ => AdminRequest::NotFound,
    }
}

fn scrub(query: &str) -> AdminRequest {
    let mut volume = None;
    let mut rate_bytes_per_s = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "volume" => match percent_decode(value) {
                Some(name) if !name.is_empty() && name.len() <= 255 => volume = Some(name),
                _ => return AdminRequest::Malformed("volume= must be a name of 1 to 255 bytes, percent-encoded"),
            },
            "rate" => match value.parse::<u64>() {
                Ok(rate) => rate_bytes_per_s = Some(rate),
                Err(_) => return AdminRequest::Malformed("rate= must be bytes per second (0: unlimited)"),
            },
            _ => return AdminRequest::Malformed("POST /scrub takes volume= and rate= only"),
        }
    }
    match volume {
        Some(volume) => AdminRequest::Scrub { volume, rate_bytes_per_s },
        None => AdminRequest::Malformed("POST /scrub needs ?volume=NAME"),
    }
}

/// A volume name parameter: percent-encoded, 1 to 255 bytes.
fn volume_name(value: &str) -> Result<String, AdminRequest> {
    match percent_decode(value) {
        Some(n) if !n.is_empty() && n.len() <= 255 => Ok(n),
        _ => Err(AdminRequest::Malformed("name= must be a name of 1 to 255 bytes, percent-encoded")),
    }
}

fn volume_delete(query: &str) -> AdminRequest {
    let mut name = None;
    let mut with_snapshots = false;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "name" => match volume_name(value) {
                Ok(n) => name = Some(n),
                Err(malformed) => return malformed,
            },
            "with_snapshots" => match value {
                "1" | "true" => with_snapshots = true,
                "0" | "false" => with_snapshots = false,
                _ => return AdminRequest::Malformed("with_snapshots= must be 1 or 0"),
            },
            _ => return AdminRequest::Malformed("POST /volumes/delete takes name= and with_snapshots= only"),
        }
    }
    match name {
        Some(name) => AdminRequest::VolumeDelete { name, with_snapshots },
        None => AdminRequest::Malformed("POST /volumes/delete needs ?name=NAME"),
    }
}

fn snapshot_create(query: &str) -> AdminRequest {
    let (mut volume, mut group, mut name) = (None, None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let slot = match key {
            "volume" => &mut volume,
            "group" => &mut group,
            "name" => &mut name,
            _ => return AdminRequest::Malformed("POST /snapshots/create takes volume= (or group=) and name= only"),
        };
        match volume_name(value) {
            Ok(n) => *slot = Some(n),
            Err(malformed) => return malformed,
        }
    }
    match (volume, group, name) {
        (Some(volume), None, Some(name)) => AdminRequest::SnapshotCreate { volume, name, group: false },
        (None, Some(volume), Some(name)) => AdminRequest::SnapshotCreate { volume, name, group: true },
        _ => AdminRequest::Malformed("POST /snapshots/create needs ?volume=VOLUME&name=NAME or ?group=GROUP&name=NAME"),
    }
}

fn snapshot_delete(query: &str) -> AdminRequest {
    let mut snapshot = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "snapshot" => match snapshot_name(value) {
                Ok(pair) => snapshot = Some(pair),
                Err(malformed) => return malformed,
            },
            _ => return AdminRequest::Malformed("POST /snapshots/delete takes snapshot= only"),
        }
    }
    match snapshot {
        Some((volume, name)) => AdminRequest::SnapshotDelete { volume, name },
        None => AdminRequest::Malformed("POST /snapshots/delete needs ?snapshot=VOLUME@NAME"),
    }
}

/// A `snapshot=VOLUME@NAME` parameter, percent-encoded.
fn snapshot_name(value: &str) -> Result<(String, String), AdminRequest> {
    let malformed = AdminRequest::Malformed("snapshot= must be VOLUME@NAME, percent-encoded");
    match percent_decode(value) {
        Some(s) if s.len() <= 511 => match s.rsplit_once('@') {
            Some((volume, name)) if !volume.is_empty() && !name.is_empty() => {
                Ok((volume.to_string(), name.to_string()))
            }
            _ => Err(malformed),
        },
        _ => Err(malformed),
    }
}

fn volume_clone(query: &str) -> AdminRequest {
    let (mut snapshot, mut name) = (None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "snapshot" => match snapshot_name(value) {
                Ok(pair) => snapshot = Some(pair),
                Err(malformed) => return malformed,
            },
            "name" => match volume_name(value) {
                Ok(n) => name = Some(n),
                Err(malformed) => return malformed,
            },
            _ => return AdminRequest::Malformed("POST /volumes/clone takes snapshot= and name= only"),
        }
    }
    match (snapshot, name) {
        (Some((volume, snapshot)), Some(name)) => AdminRequest::VolumeClone { volume, snapshot, name },
        _ => AdminRequest::Malformed("POST /volumes/clone needs ?snapshot=VOLUME@NAME&name=NEW"),
    }
}

/// `?name=NAME&size=BYTES` of a `POST` to `path`.
fn volume_sized(
    query: &str,
    path: &'static str,
    make: fn(String, u64, bool, Option<String>) -> AdminRequest,
) -> AdminRequest {
    let mut name = None;
    let mut size_bytes = None;
    let mut shrink = false;
    let mut group = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "name" => match volume_name(value) {
                Ok(n) => name = Some(n),
                Err(malformed) => return malformed,
            },
            "size" => match value.parse::<u64>() {
                Ok(size) => size_bytes = Some(size),
                Err(_) => return AdminRequest::Malformed("size= must be a number of bytes"),
            },
            "shrink" if path == "/volumes/resize" => match value {
                "1" | "true" => shrink = true,
                "0" | "false" => shrink = false,
                _ => return AdminRequest::Malformed("shrink= must be 1 or 0"),
            },
            "group" if path == "/volumes/create" => match percent_decode(value) {
                Some(g) if !g.is_empty() && g.len() <= 255 => group = Some(g),
                _ => return AdminRequest::Malformed("group= must name a consistency group (1 to 255 bytes)"),
            },
            _ => {
                return AdminRequest::Malformed(if path == "/volumes/create" {
                    "POST /volumes/create takes name=, size= and group= only"
                } else {
                    "POST /volumes/resize takes name=, size= and shrink= only"
                })
            }
        }
    }
    match (name, size_bytes) {
        (Some(name), Some(size_bytes)) => make(name, size_bytes, shrink, group),
        _ if path == "/volumes/create" => AdminRequest::Malformed("POST /volumes/create needs ?name=NAME&size=BYTES"),
        _ => AdminRequest::Malformed("POST /volumes/resize needs ?name=NAME&size=BYTES"),
    }
}

/// `%XX` escapes (and `+` as a space) decoded; `None` for a bad escape or bytes that are not
/// UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes.get(i + 1..i + 3)?;
                if !hex.iter().all(u8::is_ascii_hexdigit) {
                    return None;
                }
                out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_read_from_their_request_line() {
        assert_eq!(parse(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n"), AdminRequest::Status);
        assert_eq!(parse(b"GET /metrics?x=1 HTTP/1.0\n\n"), AdminRequest::Metrics);
        assert_eq!(parse(b"POST /failover HTTP/1.0\r\n\r\n"), AdminRequest::Failover);
        assert_eq!(parse(b"POST /drain HTTP/1.1\r\n\r\n"), AdminRequest::Drain);
        assert_eq!(parse(b"GET /failover HTTP/1.1\r\n\r\n"), AdminRequest::NotFound);
        assert_eq!(parse(b"DELETE /status HTTP/1.1\r\n\r\n"), AdminRequest::NotFound);
        assert_eq!(
            parse(b"POST /scrub?volume=vol%200&rate=1048576 HTTP/1.1\r\n\r\n"),
            AdminRequest::Scrub { volume: "vol 0".into(), rate_bytes_per_s: Some(1 << 20) }
        );
        assert_eq!(
            parse(b"POST /scrub?volume=vol0 HTTP/1.1\r\n\r\n"),
            AdminRequest::Scrub { volume: "vol0".into(), rate_bytes_per_s: None }
        );
        assert!(AdminRequest::Scrub { volume: "v".into(), rate_bytes_per_s: None }.is_order());
        assert!(AdminRequest::Failover.is_order() && !AdminRequest::Status.is_order());
        assert_eq!(
            parse(b"POST /volumes/create?name=db%2D1&size=1073741824 HTTP/1.1\r\n\r\n"),
            AdminRequest::VolumeCreate { name: "db-1".into(), size_bytes: 1 << 30, group: None }
        );
        assert!(AdminRequest::VolumeCreate { name: "v".into(), size_bytes: 4096, group: None }.is_order());
        assert_eq!(
            parse(b"POST /volumes/create?name=log&size=4096&group=db%2Dset HTTP/1.1\r\n\r\n"),
            AdminRequest::VolumeCreate { name: "log".into(), size_bytes: 4096, group: Some("db-set".into()) }
        );
        assert_eq!(parse(b"GET /volumes HTTP/1.1\r\n\r\n"), AdminRequest::VolumeList);
        assert_eq!(
            parse(b"POST /volumes/delete?name=db%2D1 HTTP/1.1\r\n\r\n"),
            AdminRequest::VolumeDelete { name: "db-1".into(), with_snapshots: false }
        );
        assert_eq!(
            parse(b"POST /volumes/delete?name=db&with_snapshots=1 HTTP/1.1\r\n\r\n"),
            AdminRequest::VolumeDelete { name: "db".into(), with_snapshots: true }
        );
        assert!(AdminRequest::VolumeDelete { name: "v".into(), with_snapshots: false }.is_order());
        assert_eq!(
            parse(b"POST /snapshots/create?volume=db&name=monday HTTP/1.1\r\n\r\n"),
            AdminRequest::SnapshotCreate { volume: "db".into(), name: "monday".into(), group: false }
        );
        assert_eq!(
            parse(b"POST /snapshots/create?group=g&name=monday HTTP/1.1\r\n\r\n"),
            AdminRequest::SnapshotCreate { volume: "g".into(), name: "monday".into(), group: true }
        );
        assert_eq!(
            parse(b"POST /snapshots/delete?snapshot=db%40monday HTTP/1.1\r\n\r\n"),
            AdminRequest::SnapshotDelete { volume: "db".into(), name: "monday".into() }
        );
        assert_eq!(parse(b"GET /snapshots HTTP/1.1\r\n\r\n"), AdminRequest::SnapshotList);
        let clone = parse(b"POST /volumes/clone?snapshot=db%40monday&name=test HTTP/1.1\r\n\r\n");
        assert_eq!(
            clone,
            AdminRequest::VolumeClone { volume: "db".into(), snapshot: "monday".into(), name: "test".into() }
        );
        assert!(clone.is_order() && !clone.is_read());
        assert!(AdminRequest::SnapshotCreate { volume: "v".into(), name: "s".into(), group: false }.is_order());
        assert!(AdminRequest::SnapshotDelete { volume: "v".into(), name: "s".into() }.is_order());
        assert!(AdminRequest::SnapshotList.is_read() && !AdminRequest::SnapshotList.is_order());
        assert_eq!(
            parse(b"POST /volumes/resize?name=db-1&size=2147483648 HTTP/1.1\r\n\r\n"),
            AdminRequest::VolumeResize { name: "db-1".into(), size_bytes: 2 << 30, shrink: false }
        );
        assert_eq!(
            parse(b"POST /volumes/resize?name=db-1&size=4096&shrink=1 HTTP/1.1\r\n\r\n"),
            AdminRequest::VolumeResize { name: "db-1".into(), size_bytes: 4096, shrink: true }
        );
        assert!(matches!(
            parse(b"POST /volumes/resize?name=db-1&size=4096&shrink=yes HTTP/1.1\r\n\r\n"),
            AdminRequest::Malformed(_)
        ));
        assert!(matches!(
            parse(b"POST /volumes/create?name=db-1&size=4096&shrink=1 HTTP/1.1\r\n\r\n"),
            AdminRequest::Malformed(_)
        ));
        assert!(AdminRequest::VolumeResize { name: "v".into(), size_bytes: 4096, shrink: false }.is_order());
        assert!(matches!(
            parse(b"POST /volumes/resize?name=db-1 HTTP/1.1\r\n\r\n"),
            AdminRequest::Malformed("POST /volumes/resize needs ?name=NAME&size=BYTES")
        ));
        assert!(matches!(parse(b"POST /volumes/delete HTTP/1.1\r\n\r\n"), AdminRequest::Malformed(_)));
        assert!(!AdminRequest::VolumeList.is_order());
        assert!(head_complete(b"GET / HTTP/1.0\r\n\r\n") && !head_complete(b"GET / HTTP/1.0\r\n"));
        assert_eq!(classify("GET", "/"), AdminRequest::StatusPage);
        assert_eq!(classify("GET", "/events"), AdminRequest::Events);
        assert_eq!(classify("POST", "/"), AdminRequest::NotFound);
        assert!(AdminRequest::StatusPage.is_read() && AdminRequest::Events.is_read() && !AdminRequest::Drain.is_read());
        assert!(matches!(classify("GET", &format!("/{}", "x".repeat(REQUEST_BYTES_MAX))), AdminRequest::Malformed(_)));
        for bad in [
            &b"POST /scrub HTTP/1.1\r\n\r\n"[..],
            b"POST /scrub?volume= HTTP/1.1\r\n\r\n",
            b"POST /scrub?volume=%zz HTTP/1.1\r\n\r\n",
            b"POST /scrub?volume=%ff HTTP/1.1\r\n\r\n",
            b"POST /scrub?volume=v&rate=fast HTTP/1.1\r\n\r\n",
            b"POST /scrub?volume=v&colour=red HTTP/1.1\r\n\r\n",
            b"POST /scrub?volume=%4 HTTP/1.1\r\n\r\n",
            b"POST /scrub?volume=%+1 HTTP/1.1\r\n\r\n",
            b"POST /volumes/create?name=v HTTP/1.1\r\n\r\n",
            b"POST /volumes/create?size=4096 HTTP/1.1\r\n\r\n",
            b"POST /volumes/create?name=v&size=-1 HTTP/1.1\r\n\r\n",
            b"POST /volumes/create?name=v&size=1&group= HTTP/1.1\r\n\r\n",
            b"POST /volumes/create?name=v&size=1&group=%zz HTTP/1.1\r\n\r\n",
            b"POST /volumes/resize?name=v&size=4096&group=g HTTP/1.1\r\n\r\n",
            b"POST /volumes/delete?name=v&with_snapshots=maybe HTTP/1.1\r\n\r\n",
            b"POST /snapshots/create?volume=v HTTP/1.1\r\n\r\n",
            b"POST /snapshots/create?volume=v&name=s&size=1 HTTP/1.1\r\n\r\n",
            b"POST /snapshots/create?volume=v&group=g&name=s HTTP/1.1\r\n\r\n",
            b"POST /snapshots/delete?snapshot=v HTTP/1.1\r\n\r\n",
            b"POST /snapshots/delete?snapshot=v@ HTTP/1.1\r\n\r\n",
            b"POST /snapshots/delete?snapshot=@s HTTP/1.1\r\n\r\n",
            b"POST /snapshots/delete HTTP/1.1\r\n\r\n",
            b"POST /volumes/clone?snapshot=db@monday HTTP/1.1\r\n\r\n",
            b"POST /volumes/clone?name=test HTTP/1.1\r\n\r\n",
            b"POST /volumes/clone?snapshot=db&name=test HTTP/1.1\r\n\r\n",
            b"POST /volumes/clone?snapshot=db@m&name=t&size=1 HTTP/1.1\r\n\r\n",
            b"",
            b"\xff\xfe /status HTTP/1.1\r\n",
            b"GET /status\r\n",
            b"GET status HTTP/1.1\r\n",
            b"GET  /status HTTP/1.1\r\n",
            b"GET /status SPDY/3\r\n",
        ] {
            assert!(matches!(parse(bad), AdminRequest::Malformed(_)), "{bad:?}");
        }
    }
}
