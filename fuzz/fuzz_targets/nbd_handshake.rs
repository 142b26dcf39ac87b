//! The NBD handshake state machine on any client bytes: never a panic, progress on every full
//! buffer, bounded output; STARTTLS handled as the driver would (TLS "established" at once).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbd::{ExportInfo, Handshake, HandshakeConfig, HANDSHAKE_INPUT_BYTES_MAX};

fuzz_target!(|data: &[u8]| {
    let Some((&config, rest)) = data.split_first() else { return };
    let exports = vec![
        ExportInfo { name: "vol0".into(), size_bytes: 1 << 30, description: "a volume".into(), read_only: false },
        ExportInfo { name: String::new(), size_bytes: 1000, description: String::new(), read_only: false },
    ];
    let mut handshake = Handshake::new(HandshakeConfig { multi_conn: config & 1 != 0, tls: config & 2 != 0 });
    // The bytes arrive in pieces whose sizes the next input byte picks.
    let mut pending: Vec<u8> = Vec::new();
    let mut offset = 0;
    let mut piece_sizes = rest.iter().rev().cycle();
    while offset < rest.len() {
        let piece = (1 + *piece_sizes.next().unwrap_or(&64) as usize * 4).min(rest.len() - offset);
        pending.extend_from_slice(&rest[offset..offset + piece]);
        offset += piece;
        loop {
            let consumed = handshake.handle_input(&pending, &exports);
            assert!(consumed <= pending.len());
            pending.drain(..consumed);
            handshake.assert_invariants();
            if let Some(output) = handshake.poll_transmit() {
                assert!(output.len() < 1 << 20);
            }
            if handshake.poll_outcome().is_some() {
                return;
            }
            if handshake.wants_tls() {
                handshake.tls_established();
                continue;
            }
            break;
        }
        assert!(pending.len() < HANDSHAKE_INPUT_BYTES_MAX, "no progress on a full buffer");
    }
});
