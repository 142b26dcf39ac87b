//! Request headers in the transmission phase, after a real handshake (structured replies and
//! block status negotiated or not): decoding never panics, and every decoded request's reply
//! encodes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbd::wire::{put_u16, put_u32, put_u64};
use nbd::{Command, Decoded, ExportInfo, Extent, Handshake, HandshakeConfig, HandshakeOutcome, REQUEST_HEADER_BYTES};

fn option(out: &mut Vec<u8>, option: u32, data: &[u8]) {
    put_u64(out, nbd::wire::IHAVEOPT);
    put_u32(out, option);
    put_u32(out, data.len() as u32);
    out.extend_from_slice(data);
}

fuzz_target!(|data: &[u8]| {
    let Some((&config, headers)) = data.split_first() else { return };
    let exports = vec![ExportInfo {
        name: "vol0".into(),
        size_bytes: (1 << 30) + 512,
        description: String::new(),
        read_only: false,
    }];
    let mut handshake = Handshake::new(HandshakeConfig { multi_conn: true, tls: false });
    let mut input = Vec::new();
    put_u32(&mut input, 3);
    if config & 1 != 0 {
        option(&mut input, nbd::wire::OPT_STRUCTURED_REPLY, &[]);
        if config & 2 != 0 {
            let mut meta = Vec::new();
            put_u32(&mut meta, 4);
            meta.extend_from_slice(b"vol0");
            put_u32(&mut meta, 1);
            put_u32(&mut meta, 15);
            meta.extend_from_slice(b"base:allocation");
            option(&mut input, nbd::wire::OPT_SET_META_CONTEXT, &meta);
        }
    }
    let mut go = Vec::new();
    put_u32(&mut go, 4);
    go.extend_from_slice(b"vol0");
    put_u16(&mut go, 0);
    option(&mut input, nbd::wire::OPT_GO, &go);
    handshake.handle_input(&input, &exports);
    let Some(HandshakeOutcome::Transmission(transmission)) = handshake.poll_outcome() else {
        panic!("the scripted handshake reaches transmission")
    };
    for header in headers.chunks_exact(REQUEST_HEADER_BYTES) {
        let header: &[u8; REQUEST_HEADER_BYTES] = header.try_into().expect("exact chunk");
        match transmission.decode_request(header) {
            Err(_) => return,
            Ok(Decoded::Disconnect) => return,
            Ok(Decoded::NoOp { handle, kind }) => {
                transmission.encode_success(handle, kind);
            }
            Ok(Decoded::Rejected(rejected)) => {
                transmission.encode_error(rejected.handle, rejected.errno, rejected.message);
            }
            Ok(Decoded::Request(request)) => {
                // Each reply as the server would encode it for this command.
                match request.command {
                    Command::Read { offset_bytes, length_bytes } => {
                        transmission.encode_read_header(request.handle, offset_bytes, length_bytes);
                    }
                    Command::BlockStatus { length_bytes, req_one, .. } => {
                        let extents = [
                            Extent { length_bytes: 4096, hole: false },
                            Extent { length_bytes: u64::from(length_bytes), hole: true },
                        ];
                        transmission.encode_block_status(request.handle, length_bytes, req_one, &extents);
                    }
                    other => {
                        transmission.encode_success(request.handle, other.kind());
                    }
                }
                transmission.encode_error(request.handle, nbd::Errno::Io, "fuzz");
            }
        }
    }
});
