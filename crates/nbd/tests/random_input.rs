//! Deterministic random input against the handshake and the request decoder: thousands of byte
//! strings, from pure noise to nearly valid messages with hostile lengths. Nothing may panic,
//! the handshake must always make progress on a full buffer, and no single allocation made by
//! the codec may exceed a small bound (a hostile length must never become a big buffer).

// `is_multiple_of` is newer than our MSRV, 1.80.
#![allow(clippy::manual_is_multiple_of)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use nbd::wire::*;
use nbd::{
    Decoded, ExportInfo, Extent, Handshake, HandshakeConfig, HandshakeOutcome, Transmission, BLOCK_SIZE_MAX_BYTES,
    HANDSHAKE_INPUT_BYTES_MAX,
};

/// Records the largest allocation made while the current thread is measuring.
struct MeasuringAllocator;

static LARGEST_ALLOCATION_BYTES: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static MEASURING: Cell<bool> = const { Cell::new(false) };
}

unsafe impl GlobalAlloc for MeasuringAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if MEASURING.with(|measuring| measuring.get()) {
            LARGEST_ALLOCATION_BYTES.fetch_max(layout.size(), Ordering::Relaxed);
        }
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if MEASURING.with(|measuring| measuring.get()) {
            LARGEST_ALLOCATION_BYTES.fetch_max(new_size, Ordering::Relaxed);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: MeasuringAllocator = MeasuringAllocator;

/// Codec allocations stay below this: a few option replies, never anything sized by a length
/// field from the client.
const CODEC_ALLOCATION_BYTES_MAX: usize = 256 * 1024;

fn measured<T>(f: impl FnOnce() -> T) -> T {
    MEASURING.with(|measuring| measuring.set(true));
    let result = f();
    MEASURING.with(|measuring| measuring.set(false));
    result
}

/// splitmix64: small, deterministic, and the same on every platform and toolchain.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn bytes(&mut self, count: usize) -> Vec<u8> {
        (0..count).map(|_| self.next() as u8).collect()
    }

    /// A length field: often small and sane, sometimes hostile.
    fn length(&mut self) -> u32 {
        match self.below(6) {
            0 => 0,
            1 => self.below(64) as u32,
            2 => self.below(5000) as u32,
            3 => u32::MAX - self.below(4) as u32,
            4 => self.next() as u32,
            _ => (self.below(1 << 16) as u32) * 512,
        }
    }
}

fn exports() -> Vec<ExportInfo> {
    vec![
        ExportInfo { name: "a".into(), size_bytes: 1 << 30, description: "A".into(), read_only: false },
        ExportInfo { name: String::new(), size_bytes: 1000, description: String::new(), read_only: false },
    ]
}

/// A client's side of a handshake: mostly well-framed options with random contents.
fn handshake_input(random: &mut Random) -> Vec<u8> {
    if random.chance(10) {
        let count = random.below(2000) as usize;
        return random.bytes(count);
    }
    let mut out = Vec::new();
    put_u32(&mut out, if random.chance(90) { random.below(4) as u32 } else { random.next() as u32 });
    for _ in 0..random.below(12) {
        put_u64(&mut out, if random.chance(97) { IHAVEOPT } else { random.next() });
        let option = if random.chance(90) { random.below(13) as u32 } else { random.next() as u32 };
        put_u32(&mut out, option);
        let data = option_data(random, option);
        let declared = if random.chance(85) { data.len() as u32 } else { random.length() };
        put_u32(&mut out, declared);
        out.extend_from_slice(&data);
    }
    if random.chance(30) {
        let count = random.below(100) as usize;
        out.extend(random.bytes(count));
    }
    out
}

fn option_data(random: &mut Random, option: u32) -> Vec<u8> {
    let name: &[u8] = match random.below(4) {
        0 => b"a",
        1 => b"",
        2 => b"zz",
        _ => &[0xff, 0xfe],
    };
    let mut out = Vec::new();
    match option {
        OPT_EXPORT_NAME => out.extend_from_slice(name),
        OPT_INFO | OPT_GO => {
            put_u32(&mut out, if random.chance(90) { name.len() as u32 } else { random.length() });
            out.extend_from_slice(name);
            let count = random.below(5);
            put_u16(&mut out, if random.chance(90) { count as u16 } else { random.next() as u16 });
            for _ in 0..count {
                put_u16(&mut out, random.below(6) as u16);
            }
        }
        OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
            put_u32(&mut out, if random.chance(90) { name.len() as u32 } else { random.length() });
            out.extend_from_slice(name);
            let count = random.below(4);
            put_u32(&mut out, if random.chance(90) { count as u32 } else { random.length() });
            for _ in 0..count {
                let query: &[u8] = match random.below(5) {
                    0 => b"base:allocation",
                    1 => b"base:",
                    2 => b"qemu:dirty-bitmap:x",
                    3 => b"nocolon",
                    _ => b"base:\xff",
                };
                put_u32(&mut out, if random.chance(90) { query.len() as u32 } else { random.length() });
                out.extend_from_slice(query);
            }
        }
        _ => {
            if random.chance(30) {
                let count = random.below(40) as usize;
                out.extend(random.bytes(count));
            }
        }
    }
    out
}

/// Feeds `input` in random pieces, as a socket would, keeping unconsumed bytes like a driver.
fn run_handshake(random: &mut Random, input: &[u8]) -> Option<HandshakeOutcome> {
    let exports = exports();
    let mut handshake = Handshake::new(HandshakeConfig { multi_conn: random.chance(50), tls: random.chance(30) });
    let mut pending: Vec<u8> = Vec::new();
    let mut offset = 0;
    loop {
        let piece = (1 + random.below(3000) as usize).min(input.len() - offset);
        pending.extend_from_slice(&input[offset..offset + piece]);
        offset += piece;
        let consumed = measured(|| handshake.handle_input(&pending, &exports));
        assert!(consumed <= pending.len());
        pending.drain(..consumed);
        if let Some(output) = measured(|| handshake.poll_transmit()) {
            assert!(output.len() < CODEC_ALLOCATION_BYTES_MAX);
        }
        if let Some(outcome) = handshake.poll_outcome() {
            return Some(outcome);
        }
        if handshake.wants_tls() {
            // As if the TLS handshake had run: the rest goes on inside it.
            handshake.tls_established();
            continue;
        }
        assert!(pending.len() < HANDSHAKE_INPUT_BYTES_MAX, "the handshake must make progress on a full buffer");
        if offset == input.len() {
            return None;
        }
    }
}

#[test]
fn random_handshakes() {
    let mut random = Random(0x5eed_0001);
    let (mut transmissions, mut aborted, mut fatal, mut unfinished) = (0, 0, 0, 0);
    for _ in 0..20_000 {
        let input = handshake_input(&mut random);
        match run_handshake(&mut random, &input) {
            Some(HandshakeOutcome::Transmission(transmission)) => {
                transmissions += 1;
                assert!(exports().contains(transmission.export()));
            }
            Some(HandshakeOutcome::Aborted) => aborted += 1,
            Some(HandshakeOutcome::Fatal(_)) => fatal += 1,
            None => unfinished += 1,
        }
    }
    // The generator must reach every ending, or it tests less than it seems to.
    assert!(transmissions > 100, "{transmissions}");
    assert!(aborted > 100, "{aborted}");
    assert!(fatal > 100, "{fatal}");
    assert!(unfinished > 100, "{unfinished}");
    let largest = LARGEST_ALLOCATION_BYTES.load(Ordering::Relaxed);
    assert!(largest <= CODEC_ALLOCATION_BYTES_MAX, "largest allocation {largest} bytes");
}

#[test]
fn random_requests() {
    let mut random = Random(0x5eed_0002);
    let transmissions: Vec<Transmission> = [(false, false), (true, false), (true, true)]
        .into_iter()
        .flat_map(|(structured, block_status)| {
            exports().into_iter().map(move |export| Transmission::for_tests(export, structured, block_status))
        })
        .collect();
    let mut requests = 0;
    for _ in 0..200_000 {
        let transmission = &transmissions[random.below(transmissions.len() as u64) as usize];
        let mut header = [0u8; REQUEST_HEADER_BYTES];
        header.copy_from_slice(&random.bytes(REQUEST_HEADER_BYTES));
        if random.chance(95) {
            header[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
            let flags = match random.below(10) {
                0..=4 => 0,
                5..=8 => 1u16 << random.below(6),
                _ => random.next() as u16,
            };
            header[4..6].copy_from_slice(&flags.to_be_bytes());
            header[6..8].copy_from_slice(&(random.below(10) as u16).to_be_bytes());
            let offset = if random.chance(80) { random.below(1 << 21) * 512 } else { random.next() };
            header[16..24].copy_from_slice(&offset.to_be_bytes());
            let length = if random.chance(50) { random.below(1 << 12) as u32 * 512 } else { random.length() };
            header[24..28].copy_from_slice(&length.to_be_bytes());
        }
        let decoded = measured(|| transmission.decode_request(&header));
        let size = transmission.export().size_bytes;
        match decoded {
            Ok(Decoded::Request(request)) => {
                requests += 1;
                use nbd::Command::*;
                let handle = request.handle;
                let reply = match request.command {
                    Read { offset_bytes, length_bytes } => {
                        assert!(length_bytes > 0 && length_bytes <= BLOCK_SIZE_MAX_BYTES);
                        assert!(offset_bytes + u64::from(length_bytes) <= size);
                        transmission.encode_read_header(handle, offset_bytes, length_bytes)
                    }
                    Write { offset_bytes, length_bytes, .. } => {
                        assert!(length_bytes > 0 && length_bytes <= BLOCK_SIZE_MAX_BYTES);
                        assert!(offset_bytes + u64::from(length_bytes) <= size);
                        transmission.encode_success(handle, request.command.kind())
                    }
                    Trim { offset_bytes, length_bytes, .. } | WriteZeroes { offset_bytes, length_bytes, .. } => {
                        assert!(length_bytes > 0);
                        assert!(offset_bytes + u64::from(length_bytes) <= size);
                        transmission.encode_success(handle, request.command.kind())
                    }
                    Flush => transmission.encode_success(handle, request.command.kind()),
                    BlockStatus { offset_bytes, length_bytes, req_one } => {
                        assert!(transmission.block_status_enabled());
                        assert!(offset_bytes + u64::from(length_bytes) <= size);
                        let extents: Vec<Extent> = (0..random.below(40))
                            .map(|_| Extent { length_bytes: random.below(9000), hole: random.chance(50) })
                            .collect();
                        let reply =
                            measured(|| transmission.encode_block_status(handle, length_bytes, req_one, &extents));
                        let descriptors = (reply.len() - 24) / 8;
                        assert!(descriptors >= 1);
                        let mut total = 0u64;
                        for chunk in reply[24..].chunks(8) {
                            let length = u32::from_be_bytes(chunk[..4].try_into().unwrap());
                            assert!(length > 0);
                            total += u64::from(length);
                            let end = offset_bytes + total;
                            assert!(end % 512 == 0 || end == size, "descriptor ends unaligned");
                        }
                        assert!(total <= u64::from(length_bytes));
                        if req_one {
                            assert_eq!(descriptors, 1);
                        }
                        reply
                    }
                };
                assert!(!reply.is_empty());
            }
            Ok(Decoded::Rejected(rejected)) => {
                let reply = measured(|| transmission.encode_error(rejected.handle, rejected.errno, rejected.message));
                assert!(reply.len() >= 16);
            }
            Ok(Decoded::NoOp { handle, kind }) => {
                let reply = measured(|| transmission.encode_success(handle, kind));
                assert!(reply.len() >= 16);
            }
            Ok(Decoded::Disconnect) | Err(_) => {}
        }
    }
    assert!(requests > 1000, "{requests}");
    let largest = LARGEST_ALLOCATION_BYTES.load(Ordering::Relaxed);
    assert!(largest > 0, "the allocator measured nothing");
    assert!(largest <= CODEC_ALLOCATION_BYTES_MAX, "largest allocation {largest} bytes");
}
