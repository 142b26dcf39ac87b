//! Opening an element's data directory that was damaged: a store with two volumes and a few
//! committed records, then bytes of its files flipped or cut as the input says. Opening (and
//! verifying, if it opens) returns an error or a store, never a panic or an abort.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    store::fuzz::open_damaged(data);
});
