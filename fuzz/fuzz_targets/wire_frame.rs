//! The element wire protocol's frame decoder on any bytes, both directions: never a panic,
//! never an allocation beyond a bounded frame, and whatever decodes encodes back to a frame
//! that decodes to the same message.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use proto::{decode_frame, encode_frame, Body, ElementMessage, HostMessage, Record};

fn round_trip<M: Body + PartialEq + std::fmt::Debug>(data: &[u8]) {
    let mut buf = BytesMut::from(data);
    // Frames as they come, until the input runs out or breaks the protocol.
    while let Ok(Some(message)) = decode_frame::<M>(&mut buf) {
        let mut encoded = BytesMut::new();
        encode_frame(&message, &mut encoded);
        let again = decode_frame::<M>(&mut encoded).expect("our own frame decodes").expect("whole");
        assert_eq!(again, message);
        assert!(encoded.is_empty());
    }
}

fuzz_target!(|data: &[u8]| {
    round_trip::<HostMessage>(data);
    round_trip::<ElementMessage>(data);
    if let Ok(record) = Record::decode(bytes::Bytes::copy_from_slice(data)) {
        let mut out = BytesMut::new();
        record.encode(&mut out);
        assert_eq!(Record::decode(out.freeze()).expect("our own record decodes"), record);
    }
});
