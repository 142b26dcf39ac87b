//! The admin endpoint's HTTP request-head parser on any bytes: never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = starfish_core::admin_request::parse(data);
});
