//! Store handshake answers: decoding and checking never panic or claim unread bytes.
#![no_main]

use chorus_transport::auth::Auth;
use chorus_transport::store::handshake;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some((answer, used))) = handshake::decode_answer(data) {
        assert!(used <= data.len() && used <= handshake::MAX_ANSWER_LEN);
        let auth = Auth::new("fuzz", "secret").expect("short job id");
        assert!(handshake::check(&auth, &[0; 16], &answer).is_err() || answer.job_id == "fuzz");
    }
});
