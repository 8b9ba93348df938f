//! TCP frame headers: any 40 bytes decode to a header that re-encodes to them, or fail.
#![no_main]

use chorus_transport::tcp::frame::{FrameHeader, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(raw) = data.get(..HEADER_LEN) else {
        return;
    };
    let raw: [u8; HEADER_LEN] = raw.try_into().expect("HEADER_LEN bytes");
    if let Ok(header) = FrameHeader::decode(&raw) {
        assert_eq!(header.encode(), raw);
    }
});
