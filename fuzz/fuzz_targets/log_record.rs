//! The element log's record parser (what crash recovery reads back) on any payload: never a
//! panic; a record it accepts re-encodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    store::fuzz::log_record(data);
});
