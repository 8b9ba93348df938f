//! Store requests and response headers: decoding never panics or claims unread bytes.
#![no_main]

use chorus_transport::store::protocol::{self, RESPONSE_HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some((_, used))) = protocol::decode_request(data) {
        assert!(used <= data.len());
    }
    if let Some(header) = data.get(..RESPONSE_HEADER_LEN) {
        let _ = protocol::decode_response_header(header.try_into().expect("header bytes"));
    }
});
