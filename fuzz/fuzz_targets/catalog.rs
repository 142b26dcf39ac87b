//! The catalog of volumes created while running (`starfish_core::catalog::Catalog::decode`) on
//! any bytes: as stored (a damaged first block), and as the body of a document of any format
//! whose checksum matches, so that the parser behind the checksum is reached. Never a panic; a
//! catalog that decodes re-encodes to a document that decodes to the same catalog.
#![no_main]

use libfuzzer_sys::fuzz_target;
use starfish_core::catalog::Catalog;

fuzz_target!(|data: &[u8]| {
    let _ = Catalog::stored_bytes(data);
    let _ = Catalog::decode(data);
    let Some((&format, body)) = data.split_first() else { return };
    let mut document = [b"SFCATLG3", b"SFCATLG2", b"SFCATLG1"][format as usize % 3].to_vec();
    document.extend_from_slice(&(body.len() as u32).to_le_bytes());
    document.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
    document.extend_from_slice(body);
    document.resize(document.len().div_ceil(4096) * 4096, 0);
    if let Ok(catalog) = Catalog::decode(&document) {
        assert_eq!(Catalog::decode(&catalog.encode()).as_ref(), Ok(&catalog), "re-encoded");
    }
});
