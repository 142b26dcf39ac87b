//! The NBD server against real clients (nbdinfo, qemu-io, qemu-img, nbdcopy, nbdsh) and against
//! raw sockets that misbehave. The backend is an in-memory disk that tracks holes.
//!
//! A test whose client program is missing prints `SKIPPED: …` and returns (it fails instead
//! when `STARFISH_REQUIRE_NBD_CLIENTS=1`). Every client runs under `timeout`, so each test is
//! bounded in time, and is waited for, so none outlives its test.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use nbd::wire::*;
use shell::nbd_server::{serve, Backend, BoxFuture, Errno, ExportInfo, Extent, ServerOptions};

const SECTOR_BYTES: usize = 512;

// ---------------------------------------------------------------------------------------------
// In-memory backend

struct Volume {
    data: Vec<u8>,
    /// One flag per 512-byte sector: written since the last trim / zeroing.
    allocated: Vec<bool>,
}

#[derive(Default)]
struct MemoryBackend {
    exports: Vec<ExportInfo>,
    volumes: HashMap<String, Mutex<Volume>>,
    read_only: AtomicBool,
    /// Every backend call sleeps this long first (to hold requests in flight).
    delay: Mutex<Duration>,
    in_flight: AtomicUsize,
    in_flight_max: AtomicUsize,
    writes_completed: AtomicUsize,
    /// Connections in the transmission phase (`Backend::opened` less `Backend::closed`).
    connections: AtomicUsize,
    /// `Backend::opened` sleeps this long before counting (to widen a race).
    open_delay: Mutex<Duration>,
}

impl MemoryBackend {
    fn new(exports: &[(&str, u64, &str)]) -> Arc<MemoryBackend> {
        let mut backend = MemoryBackend::default();
        for (name, size_bytes, description) in exports {
            backend.exports.push(ExportInfo {
                name: name.to_string(),
                size_bytes: *size_bytes,
                description: description.to_string(),
                read_only: false,
            });
            let volume = Volume {
                data: vec![0; *size_bytes as usize],
                allocated: vec![false; (*size_bytes as usize).div_ceil(SECTOR_BYTES)],
            };
            backend.volumes.insert(name.to_string(), Mutex::new(volume));
        }
        Arc::new(backend)
    }

    fn contents(&self, export: &str) -> Vec<u8> {
        self.volumes[export].lock().unwrap().data.clone()
    }

    fn set_delay(&self, delay: Duration) {
        *self.delay.lock().unwrap() = delay;
    }

    /// Runs `operation` on the volume after the configured delay, counting concurrency.
    fn call<T: Send + 'static>(
        self: &Arc<Self>,
        export: &str,
        operation: impl FnOnce(&mut Volume) -> Result<T, Errno> + Send + 'static,
    ) -> BoxFuture<Result<T, Errno>> {
        let backend = self.clone();
        let export = export.to_string();
        Box::pin(async move {
            let now = backend.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            backend.in_flight_max.fetch_max(now, Ordering::SeqCst);
            let delay = *backend.delay.lock().unwrap();
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let result = match backend.volumes.get(&export) {
                Some(volume) => operation(&mut volume.lock().unwrap()),
                None => Err(Errno::Io),
            };
            backend.in_flight.fetch_sub(1, Ordering::SeqCst);
            result
        })
    }
}

fn range(offset_bytes: u64, length_bytes: u64) -> std::ops::Range<usize> {
    offset_bytes as usize..(offset_bytes + length_bytes) as usize
}

fn sectors(offset_bytes: u64, length_bytes: u64) -> std::ops::Range<usize> {
    offset_bytes as usize / SECTOR_BYTES..((offset_bytes + length_bytes) as usize).div_ceil(SECTOR_BYTES)
}

/// The server's contract says offsets are validated; a backend would still not trust that.
fn check_bounds(volume: &Volume, offset_bytes: u64, length_bytes: u64) {
    assert!(offset_bytes + length_bytes <= volume.data.len() as u64, "server passed a bad range");
    assert!(length_bytes > 0, "server passed an empty range");
}

/// The backend is used through `Arc<dyn Backend>`; this wrapper gives it an `Arc<Self>`.
struct Shared(Arc<MemoryBackend>);

impl Backend for Shared {
    fn opened(&self, _export: &str) -> Result<(), String> {
        let delay = *self.0.open_delay.lock().unwrap();
        std::thread::sleep(delay);
        self.0.connections.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn closed(&self, _export: &str) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
    }

    fn exports(&self) -> Vec<ExportInfo> {
        self.0.exports.clone()
    }

    fn read(&self, export: &str, offset_bytes: u64, length_bytes: u32) -> BoxFuture<Result<Bytes, Errno>> {
        self.0.call(export, move |volume| {
            check_bounds(volume, offset_bytes, length_bytes.into());
            Ok(Bytes::copy_from_slice(&volume.data[range(offset_bytes, length_bytes.into())]))
        })
    }

    fn write(&self, export: &str, offset_bytes: u64, data: Bytes, _fua: bool) -> BoxFuture<Result<(), Errno>> {
        let backend = self.0.clone();
        self.0.call(export, move |volume| {
            if backend.read_only.load(Ordering::SeqCst) {
                return Err(Errno::Perm);
            }
            check_bounds(volume, offset_bytes, data.len() as u64);
            volume.data[range(offset_bytes, data.len() as u64)].copy_from_slice(&data);
            volume.allocated[sectors(offset_bytes, data.len() as u64)].fill(true);
            backend.writes_completed.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }

    fn write_zeroes(
        &self,
        export: &str,
        offset_bytes: u64,
        length_bytes: u64,
        _fua: bool,
    ) -> BoxFuture<Result<(), Errno>> {
        let backend = self.0.clone();
        self.0.call(export, move |volume| {
            if backend.read_only.load(Ordering::SeqCst) {
                return Err(Errno::Perm);
            }
            check_bounds(volume, offset_bytes, length_bytes);
            volume.data[range(offset_bytes, length_bytes)].fill(0);
            volume.allocated[sectors(offset_bytes, length_bytes)].fill(false);
            Ok(())
        })
    }

    fn trim(&self, export: &str, offset_bytes: u64, length_bytes: u64, fua: bool) -> BoxFuture<Result<(), Errno>> {
        self.write_zeroes(export, offset_bytes, length_bytes, fua)
    }

    fn flush(&self, export: &str) -> BoxFuture<Result<(), Errno>> {
        self.0.call(export, |_| Ok(()))
    }

    fn block_status(
        &self,
        export: &str,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> BoxFuture<Result<Vec<Extent>, Errno>> {
        self.0.call(export, move |volume| {
            check_bounds(volume, offset_bytes, length_bytes);
            let mut extents: Vec<Extent> = Vec::new();
            for sector in sectors(offset_bytes, length_bytes) {
                let hole = !volume.allocated[sector];
                match extents.last_mut() {
                    Some(last) if last.hole == hole => last.length_bytes += SECTOR_BYTES as u64,
                    _ => extents.push(Extent { length_bytes: SECTOR_BYTES as u64, hole }),
                }
            }
            Ok(extents)
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Log capture: the server's INFO and WARN lines, per test server

/// Collects the events at INFO level and above that one server's runtime threads emit.
#[derive(Clone, Default)]
struct LogCapture {
    lines: Arc<Mutex<Vec<(tracing::Level, String)>>>,
    next_span_id: Arc<AtomicUsize>,
}

impl LogCapture {
    fn lines(&self) -> Vec<(tracing::Level, String)> {
        self.lines.lock().unwrap().clone()
    }

    /// Waits (boundedly) until `count` lines were logged; a connection logs as it ends, which
    /// may be just after its client saw the socket close.
    fn wait_for_lines(&self, count: usize) -> Vec<(tracing::Level, String)> {
        for _ in 0..500 {
            if self.lines.lock().unwrap().len() >= count {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.lines()
    }
}

struct MessageVisitor(String);

impl tracing::field::Visit for MessageVisitor {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl tracing::Subscriber for LogCapture {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::INFO
    }

    fn new_span(&self, _span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(self.next_span_id.fetch_add(1, Ordering::Relaxed) as u64 + 1)
    }

    fn record(&self, _span: &tracing::span::Id, _values: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _span: &tracing::span::Id, _follows: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut visitor = MessageVisitor(String::new());
        event.record(&mut visitor);
        self.lines.lock().unwrap().push((*event.metadata().level(), visitor.0));
    }

    fn enter(&self, _span: &tracing::span::Id) {}

    fn exit(&self, _span: &tracing::span::Id) {}
}

// ---------------------------------------------------------------------------------------------
// Server and client harness

const MIB: u64 = 1024 * 1024;

/// A server on 127.0.0.1 with its own runtime; dropping it stops everything it runs.
struct Server {
    runtime: Option<tokio::runtime::Runtime>,
    port: u16,
    backend: Arc<MemoryBackend>,
    log: LogCapture,
}

impl Server {
    fn start(backend: Arc<MemoryBackend>, options: ServerOptions) -> Server {
        let log = LogCapture::default();
        let dispatch = tracing::Dispatch::new(log.clone());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .on_thread_start(move || {
                // The runtime's threads live as long as the runtime: keep the default for good.
                std::mem::forget(tracing::dispatcher::set_default(&dispatch));
            })
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("a port on 127.0.0.1");
        let port = listener.local_addr().unwrap().port();
        let shared: Arc<dyn Backend> = Arc::new(Shared(backend.clone()));
        runtime.spawn(async move {
            if let Err(error) = serve(listener, shared, options).await {
                panic!("serve failed: {error}");
            }
        });
        Server { runtime: Some(runtime), port, backend, log }
    }

    fn standard() -> Server {
        let backend = MemoryBackend::new(&[
            ("vol", 64 * MIB, "the main test volume"),
            ("small", MIB, ""),
            ("img", 8 * MIB, "a disk image"),
        ]);
        Server::start(backend, ServerOptions { multi_conn: true, ..ServerOptions::default() })
    }

    fn url(&self, export: &str) -> String {
        format!("nbd://127.0.0.1:{}/{export}", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

/// Seconds any one client invocation may take before `timeout` kills it.
const CLIENT_TIMEOUT_SECS: &str = "120";

/// Whether `program` can run here; otherwise says the test is skipped (or fails, in CI mode).
fn client_available(program: &str, probe: &[&str]) -> bool {
    let ok = client_command(program).args(probe).output().map(|output| output.status.success()).unwrap_or(false);
    if !ok {
        if std::env::var("STARFISH_REQUIRE_NBD_CLIENTS").as_deref() == Ok("1") {
            panic!("{program} is required but does not run here");
        }
        eprintln!("SKIPPED: {program} is not installed or does not run here");
    }
    ok
}

fn client_command(program: &str) -> Command {
    let mut command = Command::new("timeout");
    command.args(["--kill-after=5", CLIENT_TIMEOUT_SECS, program]);
    // nbdsh runs `python3 -m nbd`: the system python has the module, other pythons may not.
    let path = std::env::var("PATH").unwrap_or_default();
    command.env("PATH", format!("/usr/bin:/bin:{path}"));
    command
}

/// Runs a client and returns its stdout; fails the test with its stderr if it fails.
fn run(program: &str, args: &[&str]) -> String {
    let output = run_raw(program, args);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{program} {args:?} failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn run_raw(program: &str, args: &[&str]) -> Output {
    client_command(program).args(args).output().unwrap_or_else(|error| panic!("cannot run {program}: {error}"))
}

/// A scratch directory removed when dropped.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(name: &str) -> ScratchDir {
        let path = std::env::temp_dir().join(format!("starfish-nbd-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        ScratchDir(path)
    }

    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn path_str(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Deterministic pseudo-random bytes (splitmix64).
fn pseudo_random_bytes(seed: u64, count: usize) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(count + 8);
    while out.len() < count {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(count);
    out
}

// ---------------------------------------------------------------------------------------------
// Real clients

#[test]
fn nbdinfo_shows_size_block_sizes_and_flags() {
    if !client_available("nbdinfo", &["--version"]) {
        return;
    }
    let server = Server::standard();
    let output = run("nbdinfo", &[&server.url("vol")]);
    for expected in [
        "export-size: 67108864",
        "description: the main test volume",
        "block_size_minimum: 512",
        "block_size_preferred: 4096",
        "block_size_maximum: 33554432",
        "is_read_only: false",
        "can_flush: true",
        "can_fua: true",
        "can_trim: true",
        "can_zero: true",
        "can_fast_zero: true",
        "can_df: true",
        "can_multi_conn: true",
        "can_cache: false",
        "base:allocation",
    ] {
        assert!(output.contains(expected), "nbdinfo output lacks {expected:?}:\n{output}");
    }
}

#[test]
fn nbdinfo_lists_every_export() {
    if !client_available("nbdinfo", &["--version"]) {
        return;
    }
    let server = Server::standard();
    let output = run("nbdinfo", &["--list", &format!("nbd://127.0.0.1:{}", server.port)]);
    for expected in [
        "export=\"vol\":",
        "description: the main test volume",
        "export-size: 67108864",
        "export=\"small\":",
        "export-size: 1048576",
        "export=\"img\":",
        "description: a disk image",
    ] {
        assert!(output.contains(expected), "nbdinfo --list output lacks {expected:?}:\n{output}");
    }
    // An unknown export is refused with an error the client can show.
    let output = run_raw("nbdinfo", &[&server.url("nope")]);
    assert!(!output.status.success());
}

#[test]
fn nbdinfo_map_shows_holes_and_data() {
    if !client_available("nbdinfo", &["--version"]) || !client_available("qemu-io", &["--version"]) {
        return;
    }
    let server = Server::standard();
    let (ok, output) = qemu_io(&server.url("small"), &["write -P 0x5a 256k 128k"]);
    assert!(ok, "qemu-io:\n{output}");
    let output = run("nbdinfo", &["--map", &server.url("small")]);
    let rows: Vec<Vec<&str>> = output.lines().map(|line| line.split_whitespace().collect()).collect();
    let expected =
        [["0", "262144", "3", "hole,zero"], ["262144", "131072", "0", "data"], ["393216", "655360", "3", "hole,zero"]];
    assert_eq!(rows, expected.map(|row| row.to_vec()).to_vec(), "nbdinfo --map:\n{output}");
}

/// Runs qemu-io on `url` with one `-c` per command; returns stdout and stderr together.
fn qemu_io(url: &str, commands: &[&str]) -> (bool, String) {
    let mut args = vec!["-f", "raw", url];
    for command in commands {
        args.extend(["-c", command]);
    }
    let output = run_raw("qemu-io", &args);
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

fn all_bytes_are(data: &[u8], value: u8) -> bool {
    data.iter().all(|byte| *byte == value)
}

#[test]
fn qemu_io_writes_reads_discards_and_zeroes() {
    if !client_available("qemu-io", &["--version"]) {
        return;
    }
    let server = Server::standard();
    let url = server.url("vol");
    let (ok, output) = qemu_io(
        &url,
        &[
            "write -P 0xab 0 1M",
            "read -P 0xab 0 1M",
            "write -P 0xcd 3M 64k",
            "write -z 1M 1M",
            "read -P 0 1M 1M",
            "discard 0 512k",
            "read -P 0xab 512k 512k",
            "read -P 0xcd 3M 64k",
            "flush",
        ],
    );
    assert!(ok, "qemu-io:\n{output}");
    assert!(!output.contains("Pattern verification failed"), "qemu-io:\n{output}");
    assert!(!output.to_lowercase().contains("error"), "qemu-io:\n{output}");
    let data = server.backend.contents("vol");
    let mib = MIB as usize;
    assert!(all_bytes_are(&data[..mib / 2], 0), "the discarded range");
    assert!(all_bytes_are(&data[mib / 2..mib], 0xab));
    assert!(all_bytes_are(&data[mib..2 * mib], 0), "the zeroed range");
    assert!(all_bytes_are(&data[3 * mib..3 * mib + 65536], 0xcd));

    // qemu turns unaligned I/O into aligned requests itself (it honours the advertised minimum
    // block size, with read-modify-write), so that works too.
    let (ok, output) = qemu_io(&url, &["write -P 0x11 1000 100", "read -P 0x11 1000 100"]);
    assert!(ok && !output.contains("Pattern verification failed"), "qemu-io:\n{output}");

    // A volume that turns read-only at runtime refuses writes with EPERM.
    server.backend.read_only.store(true, Ordering::SeqCst);
    let (_, output) = qemu_io(&url, &["write -P 0x77 0 4k"]);
    assert!(output.contains("Operation not permitted"), "qemu-io:\n{output}");
}

#[test]
fn qemu_img_converts_a_sparse_image_in_and_out() {
    if !client_available("qemu-img", &["--version"]) {
        return;
    }
    let server = Server::standard();
    let dir = ScratchDir::new("qemu-img");
    let source = dir.file("source.img");
    let image_bytes = 8 * MIB as usize;
    // A sparse file: data at 1 MiB (64 KiB) and at 5 MiB (1 MiB), holes elsewhere.
    {
        let mut file = std::fs::File::create(&source).unwrap();
        file.set_len(image_bytes as u64).unwrap();
        use std::io::{Seek, SeekFrom};
        file.seek(SeekFrom::Start(MIB)).unwrap();
        file.write_all(&pseudo_random_bytes(1, 65536)).unwrap();
        file.seek(SeekFrom::Start(5 * MIB)).unwrap();
        file.write_all(&pseudo_random_bytes(2, MIB as usize)).unwrap();
    }
    let url = server.url("img");
    run("qemu-img", &["convert", "-n", "-f", "raw", "-O", "raw", path_str(&source), &url]);
    assert_eq!(server.backend.contents("img"), std::fs::read(&source).unwrap());

    // The holes survived the copy: qemu-img map sees exactly the two data ranges.
    let map = run("qemu-img", &["map", "--output=json", "-f", "raw", &url]);
    let data_ranges: Vec<(u64, u64)> = map
        .lines()
        .filter(|line| line.contains("\"data\": true"))
        .map(|line| (json_number(line, "start"), json_number(line, "length")))
        .collect();
    assert_eq!(data_ranges, vec![(MIB, 65536), (5 * MIB, MIB)], "qemu-img map:\n{map}");

    let copy = dir.file("copy.img");
    run("qemu-img", &["convert", "-f", "raw", "-O", "raw", &url, path_str(&copy)]);
    assert_eq!(std::fs::read(&copy).unwrap(), std::fs::read(&source).unwrap());
    use std::os::unix::fs::MetadataExt;
    let allocated_bytes = std::fs::metadata(&copy).unwrap().blocks() * 512;
    assert!(allocated_bytes < image_bytes as u64 / 2, "the copy is not sparse: {allocated_bytes} bytes allocated");
}

/// The number after `"key": ` in one line of qemu-img's JSON output.
fn json_number(line: &str, key: &str) -> u64 {
    let start = line.find(&format!("\"{key}\": ")).unwrap_or_else(|| panic!("no {key} in {line}")) + key.len() + 4;
    line[start..].chars().take_while(|c| c.is_ascii_digit()).collect::<String>().parse().unwrap()
}

#[test]
fn nbdcopy_round_trip_is_byte_exact() {
    if !client_available("nbdcopy", &["--version"]) {
        return;
    }
    let backend = MemoryBackend::new(&[("copy", 16 * MIB, "")]);
    let server = Server::start(backend, ServerOptions { multi_conn: true, ..ServerOptions::default() });
    let dir = ScratchDir::new("nbdcopy");
    let source = dir.file("source.img");
    let contents = pseudo_random_bytes(3, 16 * MIB as usize);
    std::fs::write(&source, &contents).unwrap();
    let url = server.url("copy");
    // nbdcopy opens several connections (we advertise multi-conn) and many requests on each.
    run("nbdcopy", &["--connections=4", "--requests=16", path_str(&source), &url]);
    assert!(server.backend.contents("copy") == contents, "the export differs from the source");
    let back = dir.file("back.img");
    run("nbdcopy", &["--connections=4", &url, path_str(&back)]);
    assert!(std::fs::read(&back).unwrap() == contents, "the copy back differs from the source");
}

#[test]
fn nbdsh_malformed_requests_get_the_errors_the_spec_prescribes() {
    if !client_available("nbdsh", &["-c", "pass"]) {
        return;
    }
    let server = Server::standard();
    // Client-side checks are off (strict mode 0) so the requests reach the server. Both reply
    // styles are tried: structured replies (the default) and simple replies.
    let script = format!(
        r#"
import errno
MIB = 1024 * 1024

def expect(code, f):
    try:
        f()
    except nbd.Error as e:
        assert e.errnum == code, "expected %s, got %r" % (errno.errorcode[code], e)
        # The server said so, not a check in libnbd itself.
        assert "command failed" in e.string, e.string
    else:
        raise AssertionError("no error, expected %s" % errno.errorcode[code])

for structured in (True, False):
    h = nbd.NBD()
    h.set_request_structured_replies(structured)
    h.set_strict_mode(0)
    h.connect_uri("{url}")
    assert h.get_structured_replies_negotiated() == structured
    size = h.get_size()
    expect(errno.EINVAL, lambda: h.pread(512, size))            # beyond the end
    expect(errno.EINVAL, lambda: h.pread(1024, size - 512))     # straddling the end
    expect(errno.EINVAL, lambda: h.pread(33 * MIB, 0))          # over the maximum block size
    expect(errno.EINVAL, lambda: h.pread(512, 1))               # unaligned offset
    expect(errno.EINVAL, lambda: h.pread(100, 0))               # unaligned length
    expect(errno.ENOSPC, lambda: h.pwrite(b"x" * 512, size))    # write beyond the end
    expect(errno.EINVAL, lambda: h.pwrite(b"x" * (33 * MIB), 0))  # oversized write: payload drained
    expect(errno.EINVAL, lambda: h.trim(512, size))
    expect(errno.ENOSPC, lambda: h.zero(512, size))
    expect(errno.EINVAL, lambda: h.pread(512, 0, nbd.CMD_FLAG_REQ_ONE))  # flag not for reads
    if structured:
        h.pread(512, 0, nbd.CMD_FLAG_DF)
    else:
        expect(errno.EINVAL, lambda: h.pread(512, 0, nbd.CMD_FLAG_DF))
    expect(errno.ENOTSUP, lambda: h.zero(512, 0, nbd.CMD_FLAG_FAST_ZERO))
    # Still in business after all that, and zero-length requests do no harm.
    h.pwrite(b"\x42" * 4096, 8192, nbd.CMD_FLAG_FUA)
    assert h.pread(4096, 8192) == b"\x42" * 4096
    assert h.pread(0, 0) == b""
    h.flush()
    h.zero(4096, 8192, nbd.CMD_FLAG_NO_HOLE)
    assert h.pread(4096, 8192) == bytes(4096)
    h.shutdown()
print("all checks passed")
"#,
        url = server.url("vol")
    );
    let output = run("nbdsh", &["-c", &script]);
    assert!(output.contains("all checks passed"), "nbdsh:\n{output}");
}

// ---------------------------------------------------------------------------------------------
// Raw sockets: misbehaving clients

/// A hand-driven NBD client with simple replies, for sending what real clients never would.
struct RawClient {
    stream: TcpStream,
}

impl RawClient {
    fn connect(port: u16) -> RawClient {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to the server");
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        stream.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
        RawClient { stream }
    }

    fn read_exact(&mut self, count: usize) -> Vec<u8> {
        let mut buffer = vec![0; count];
        self.stream.read_exact(&mut buffer).expect("read from the server");
        buffer
    }

    fn read_greeting(&mut self) {
        let greeting = self.read_exact(18);
        assert_eq!(&greeting[..16], b"NBDMAGICIHAVEOPT");
    }

    /// Fixed newstyle handshake ending in NBD_OPT_GO; returns the export size.
    fn handshake(&mut self, export: &str) -> u64 {
        self.read_greeting();
        let mut out = Vec::new();
        put_u32(&mut out, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
        put_u64(&mut out, IHAVEOPT);
        put_u32(&mut out, OPT_GO);
        put_u32(&mut out, 4 + export.len() as u32 + 2);
        put_u32(&mut out, export.len() as u32);
        out.extend_from_slice(export.as_bytes());
        put_u16(&mut out, 0);
        self.stream.write_all(&out).unwrap();
        let mut size = None;
        loop {
            let header = self.read_exact(OPTION_REPLY_HEADER_BYTES);
            let mut reader = Reader::new(&header);
            assert_eq!(reader.u64(), Some(OPTION_REPLY_MAGIC));
            assert_eq!(reader.u32(), Some(OPT_GO));
            let reply_type = reader.u32().unwrap();
            let length = reader.u32().unwrap() as usize;
            let payload = self.read_exact(length);
            match reply_type {
                REP_ACK => return size.expect("NBD_INFO_EXPORT before NBD_REP_ACK"),
                REP_INFO if payload[..2] == INFO_EXPORT.to_be_bytes() => {
                    size = Reader::new(&payload[2..]).u64();
                }
                REP_INFO => {}
                other => panic!("NBD_OPT_GO failed with reply type {other:#x}"),
            }
        }
    }

    fn request(&self, flags: u16, command: u16, handle: u64, offset: u64, length: u32) -> Vec<u8> {
        let mut out = Vec::new();
        put_u32(&mut out, REQUEST_MAGIC);
        put_u16(&mut out, flags);
        put_u16(&mut out, command);
        put_u64(&mut out, handle);
        put_u64(&mut out, offset);
        put_u32(&mut out, length);
        out
    }

    /// Reads one simple reply: (error, handle).
    fn read_reply(&mut self) -> (u32, u64) {
        let header = self.read_exact(SIMPLE_REPLY_HEADER_BYTES);
        let mut reader = Reader::new(&header);
        assert_eq!(reader.u32(), Some(SIMPLE_REPLY_MAGIC));
        (reader.u32().unwrap(), reader.u64().unwrap())
    }

    fn write(&mut self, handle: u64, offset: u64, data: &[u8]) {
        let mut out = self.request(0, CMD_WRITE, handle, offset, data.len() as u32);
        out.extend_from_slice(data);
        self.stream.write_all(&out).unwrap();
        assert_eq!(self.read_reply(), (0, handle));
    }

    fn read(&mut self, handle: u64, offset: u64, length: u32) -> Vec<u8> {
        let out = self.request(0, CMD_READ, handle, offset, length);
        self.stream.write_all(&out).unwrap();
        assert_eq!(self.read_reply(), (0, handle));
        self.read_exact(length as usize)
    }

    /// A write and a read back of a pattern that is new for `seed`.
    fn round_trip(&mut self, seed: u64) {
        let data = pseudo_random_bytes(seed, 8192);
        self.write(seed, 4096 * seed, &data);
        assert_eq!(self.read(seed + 1, 4096 * seed, 8192), data);
    }

    /// Whether the server closes the connection (EOF or reset) before the read timeout.
    fn closed_by_server(&mut self) -> bool {
        let mut buffer = [0u8; 4096];
        loop {
            match self.stream.read(&mut buffer) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(error) => panic!("the server did not close the connection: {error}"),
            }
        }
    }
}

/// What `starfish volume resize --shrink` and `volume delete` rely on: a client that has
/// heard the handshake end is already counted as using its export (once a test saw a shrink
/// pass while a libnbd client had just connected).
#[test]
fn a_connection_is_counted_before_its_client_hears_the_handshake_end() {
    let server = Server::standard();
    *server.backend.open_delay.lock().unwrap() = Duration::from_millis(200);
    for round in 0..3 {
        let mut client = RawClient::connect(server.port);
        assert_eq!(client.handshake("vol"), 64 * MIB);
        let counted = server.backend.connections.load(Ordering::SeqCst);
        assert_eq!(counted, 1, "round {round}: the client is in transmission, the backend counts {counted}");
        client.round_trip(round + 1);
        drop(client);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while server.backend.connections.load(Ordering::SeqCst) != 0 {
            assert!(std::time::Instant::now() < deadline, "round {round}: a closed connection is still counted");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[test]
fn garbage_ends_only_its_own_connection() {
    let server = Server::standard();
    let mut bystander = RawClient::connect(server.port);
    assert_eq!(bystander.handshake("vol"), 64 * MIB);
    bystander.round_trip(1);

    // Garbage in the transmission phase.
    let mut vandal = RawClient::connect(server.port);
    vandal.handshake("vol");
    let mut garbage = pseudo_random_bytes(7, 64 * 1024);
    garbage[0] = 0; // not the request magic
    let _ = vandal.stream.write_all(&garbage);
    assert!(vandal.closed_by_server());

    // Garbage in the handshake.
    let mut vandal = RawClient::connect(server.port);
    vandal.read_greeting();
    let _ = vandal.stream.write_all(&pseudo_random_bytes(8, 4096));
    assert!(vandal.closed_by_server());

    // A valid header followed by garbage where the next header should be.
    let mut vandal = RawClient::connect(server.port);
    vandal.handshake("vol");
    let mut bytes = vandal.request(0, CMD_FLUSH, 5, 0, 0);
    bytes.extend_from_slice(b"this is not an NBD request header");
    vandal.stream.write_all(&bytes).unwrap();
    assert_eq!(vandal.read_reply(), (0, 5));
    assert!(vandal.closed_by_server());

    // The bystander, connected all along, and a newcomer are both served.
    bystander.round_trip(3);
    let mut newcomer = RawClient::connect(server.port);
    newcomer.handshake("small");
    newcomer.round_trip(5);

    // One warning per vandal, saying what went wrong, and nothing else.
    let lines = server.log.wait_for_lines(3);
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(lines.iter().all(|(level, _)| *level == tracing::Level::WARN), "{lines:?}");
    assert_eq!(lines.iter().filter(|(_, line)| line.contains("bad request magic")).count(), 2, "{lines:?}");
    assert_eq!(lines.iter().filter(|(_, line)| line.contains("protocol violation")).count(), 3, "{lines:?}");
}

#[test]
fn clients_vanishing_mid_request_leave_others_alone() {
    let server = Server::standard();
    let mut bystander = RawClient::connect(server.port);
    bystander.handshake("vol");

    // Gone in the middle of a write payload.
    let mut leaver = RawClient::connect(server.port);
    leaver.handshake("vol");
    let mut bytes = leaver.request(0, CMD_WRITE, 1, 0, MIB as u32);
    bytes.extend_from_slice(&[0xee; 1000]);
    leaver.stream.write_all(&bytes).unwrap();
    drop(leaver);

    // Gone in the middle of a request header.
    let mut leaver = RawClient::connect(server.port);
    leaver.handshake("vol");
    let bytes = leaver.request(0, CMD_READ, 1, 0, 4096);
    leaver.stream.write_all(&bytes[..10]).unwrap();
    drop(leaver);

    // Gone in the middle of the handshake.
    let mut leaver = RawClient::connect(server.port);
    leaver.read_greeting();
    leaver.stream.write_all(&[0, 0]).unwrap();
    drop(leaver);

    bystander.round_trip(1);
    assert!(server.backend.contents("vol")[..1000].iter().all(|byte| *byte != 0xee));
    let mut newcomer = RawClient::connect(server.port);
    newcomer.handshake("vol");
    newcomer.round_trip(3);

    let lines = server.log.wait_for_lines(3);
    let messages: Vec<&str> = lines.iter().map(|(_, line)| line.as_str()).collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_eq!(messages.iter().filter(|line| line.contains("in the middle of a request")).count(), 2, "{lines:?}");
    assert_eq!(messages.iter().filter(|line| line.contains("during the handshake")).count(), 1, "{lines:?}");
}

const ENOSPC: u32 = 28;

/// A refused write's payload is drained after large writes of several sizes, its end sent
/// late: every reply comes and the connection stays in business. Large payloads set the
/// socket's wake-up mark (`low_water`); every read sets it first, the drain's too, so no mark
/// left from a large payload waits for bytes that never come. (With the drain's read not
/// setting it, this test still passed: a large payload's reads are sized to it, so the
/// refused write's header was never read along with its end.)
#[test]
fn a_refused_write_after_a_large_one_is_drained_and_answered() {
    let server = Server::standard();
    let mut client = RawClient::connect(server.port);
    let size = client.handshake("vol");
    let mut handle = 0;
    for (round, kib) in [1024usize, 200, 3000, 500, 2048].into_iter().enumerate() {
        let data = pseudo_random_bytes(11 + round as u64, kib * 1024);
        let mut bytes = Vec::new();
        for _ in 0..2 {
            handle += 1;
            bytes.extend_from_slice(&client.request(0, CMD_WRITE, handle, 0, data.len() as u32));
            bytes.extend_from_slice(&data);
        }
        bytes.extend_from_slice(&client.request(0, CMD_WRITE, handle + 1, size, 64 * 1024));
        bytes.extend_from_slice(&[0xee; 100]);
        client.stream.write_all(&bytes).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        client.stream.write_all(&[0xee; 64 * 1024 - 100]).unwrap();
        // Requests run concurrently: their replies come in any order.
        let mut replies = [client.read_reply(), client.read_reply(), client.read_reply()];
        replies.sort_by_key(|&(_, handle)| handle);
        assert_eq!(replies, [(0, handle - 1), (0, handle), (ENOSPC, handle + 1)], "round {round}");
        handle += 1;
        assert!(server.backend.contents("vol")[..data.len()] == data[..], "round {round}: the large write differs");
    }
    client.round_trip(handle + 1);
}

#[test]
fn stalled_handshake_times_out() {
    let backend = MemoryBackend::new(&[("vol", MIB, "")]);
    let options = ServerOptions { handshake_timeout: Duration::from_millis(300), ..ServerOptions::default() };
    let server = Server::start(backend, options);
    let mut staller = RawClient::connect(server.port);
    staller.read_greeting();
    let mut worker = RawClient::connect(server.port);
    worker.handshake("vol");
    assert!(staller.closed_by_server());
    let lines = server.log.wait_for_lines(1);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0].0, tracing::Level::WARN);
    assert!(lines[0].1.contains("handshake not finished within 300ms"), "{lines:?}");
    // The timeout covers the handshake only: an idle client in transmission stays connected.
    std::thread::sleep(Duration::from_millis(600));
    worker.round_trip(1);
}

#[test]
fn disconnect_finishes_requests_in_flight() {
    let backend = MemoryBackend::new(&[("vol", MIB, "")]);
    backend.set_delay(Duration::from_millis(200));
    let server = Server::start(backend, ServerOptions::default());
    let mut client = RawClient::connect(server.port);
    client.handshake("vol");
    // Eight writes and the disconnect in one go: every write is answered before the close.
    let mut bytes = Vec::new();
    for handle in 0..8u64 {
        bytes.extend(client.request(0, CMD_WRITE, handle, handle * 4096, 4096));
        bytes.extend_from_slice(&[handle as u8 + 1; 4096]);
    }
    bytes.extend(client.request(0, CMD_DISC, 99, 0, 0));
    client.stream.write_all(&bytes).unwrap();
    let mut handles: Vec<u64> = (0..8)
        .map(|_| client.read_reply())
        .map(|(error, handle)| {
            assert_eq!(error, 0);
            handle
        })
        .collect();
    handles.sort();
    assert_eq!(handles, (0..8).collect::<Vec<u64>>());
    assert!(client.closed_by_server());
    assert_eq!(server.backend.writes_completed.load(Ordering::SeqCst), 8);
    let lines = server.log.wait_for_lines(1);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0].0, tracing::Level::INFO);
    assert!(lines[0].1.contains("NBD_CMD_DISC"), "{lines:?}");
    let data = server.backend.contents("vol");
    for handle in 0..8usize {
        assert!(data[handle * 4096..(handle + 1) * 4096].iter().all(|byte| *byte == handle as u8 + 1));
    }
}

#[test]
fn requests_run_concurrently_up_to_the_bound() {
    let backend = MemoryBackend::new(&[("vol", MIB, "")]);
    backend.set_delay(Duration::from_millis(50));
    let options = ServerOptions { in_flight_requests_max: 4, ..ServerOptions::default() };
    let server = Server::start(backend, options);
    let mut client = RawClient::connect(server.port);
    client.handshake("vol");
    let mut bytes = Vec::new();
    for handle in 0..32u64 {
        bytes.extend(client.request(0, CMD_READ, handle, handle * 4096, 4096));
    }
    client.stream.write_all(&bytes).unwrap();
    let mut handles = Vec::new();
    for _ in 0..32 {
        let (error, handle) = client.read_reply();
        assert_eq!(error, 0);
        client.read_exact(4096);
        handles.push(handle);
    }
    handles.sort();
    assert_eq!(handles, (0..32).collect::<Vec<u64>>());
    let in_flight_max = server.backend.in_flight_max.load(Ordering::SeqCst);
    assert!(in_flight_max <= 4, "{in_flight_max} requests were in flight");
    assert!(in_flight_max >= 2, "requests were not served concurrently");
}

#[test]
fn data_in_flight_is_bounded() {
    let backend = MemoryBackend::new(&[("vol", 128 * MIB, "")]);
    backend.set_delay(Duration::from_millis(50));
    let options = ServerOptions { in_flight_bytes_max: 32 * MIB, ..ServerOptions::default() };
    let server = Server::start(backend, options);
    let mut client = RawClient::connect(server.port);
    client.handshake("vol");
    let length = 16 * MIB as u32;
    let mut bytes = Vec::new();
    for handle in 0..8u64 {
        bytes.extend(client.request(0, CMD_READ, handle, handle * u64::from(length), length));
    }
    client.stream.write_all(&bytes).unwrap();
    for _ in 0..8 {
        assert_eq!(client.read_reply().0, 0);
        client.read_exact(length as usize);
    }
    // 32 MiB of data in flight is two 16 MiB reads, although 64 requests would be allowed.
    let in_flight_max = server.backend.in_flight_max.load(Ordering::SeqCst);
    assert!(in_flight_max <= 2, "{in_flight_max} reads of 16 MiB were in flight");
}

#[test]
fn invalid_options_are_rejected() {
    let server = Server::standard();
    let too_small = ServerOptions { in_flight_bytes_max: 1024, ..ServerOptions::default() };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let result = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        serve(listener, Arc::new(Shared(server.backend.clone())), too_small).await
    });
    assert_eq!(result.unwrap_err().kind(), std::io::ErrorKind::InvalidInput);
}
