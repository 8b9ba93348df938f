//! Property tests of every decoder that reads bytes from the network: whatever
//! arrives, they return an error or a value, never panic, never claim more bytes
//! than they were given, and never ask for a body larger than the limits.

use chorus_transport::auth::{Auth, NONCE_LEN};
use chorus_transport::store::handshake;
use chorus_transport::store::protocol::{
    self, Request, MAX_KEYS, MAX_KEY_LEN, MAX_VALUE_LEN, REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN,
};
use chorus_transport::tcp::frame::{FrameHeader, HEADER_LEN};
use proptest::prelude::*;

fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

fn encode(request: &Request) -> Vec<u8> {
    match request {
        Request::Set { key, value } => protocol::encode_set(key, value),
        Request::Get { key } => protocol::encode_get(key),
        Request::Add { key, delta } => protocol::encode_add(key, *delta),
        Request::Wait { keys } => protocol::encode_wait(&refs(keys)),
        Request::Check { keys } => protocol::encode_check(&refs(keys)),
        Request::Hold { hold: None } => protocol::encode_hold("", b""),
        Request::Hold {
            hold: Some((key, value)),
        } => protocol::encode_hold(key, value),
    }
}

fn request() -> impl Strategy<Value = Request> {
    let key = || "[a-z0-9/_]{1,40}";
    prop_oneof![
        (key(), proptest::collection::vec(any::<u8>(), 0..300))
            .prop_map(|(key, value)| Request::Set { key, value }),
        key().prop_map(|key| Request::Get { key }),
        (key(), any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
        proptest::collection::vec(key(), 0..6).prop_map(|keys| Request::Wait { keys }),
        proptest::collection::vec(key(), 0..6).prop_map(|keys| Request::Check { keys }),
        proptest::option::of((key(), proptest::collection::vec(any::<u8>(), 0..300)))
            .prop_map(|hold| Request::Hold { hold }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn frame_headers_decode_or_fail_cleanly(bytes in proptest::array::uniform32(any::<u8>()), tail in any::<u64>()) {
        let mut raw = [0u8; HEADER_LEN];
        raw[..32].copy_from_slice(&bytes);
        raw[32..].copy_from_slice(&tail.to_le_bytes());
        if let Ok(header) = FrameHeader::decode(&raw) {
            prop_assert_eq!(header.encode(), raw);
        }
    }

    #[test]
    fn frame_headers_round_trip(tag in any::<u64>(), seq in any::<u64>(), msg_len in any::<u64>(), stripe_len in any::<u64>()) {
        let header = FrameHeader { tag, seq, msg_len, stripe_len };
        prop_assert_eq!(FrameHeader::decode(&header.encode()), Ok(header));
    }

    #[test]
    fn store_requests_never_panic_or_overrun(bytes in proptest::collection::vec(any::<u8>(), 0..200), magic in any::<bool>()) {
        let mut buf = bytes;
        if magic && buf.len() >= 4 {
            buf[..4].copy_from_slice(b"CHS1");
        }
        if let Ok(Some((_, used))) = protocol::decode_request(&buf) {
            prop_assert!(used <= buf.len());
        }
    }

    #[test]
    fn store_requests_round_trip_and_prefixes_wait(request in request()) {
        let frame = encode(&request);
        let decoded = protocol::decode_request(&frame).unwrap();
        prop_assert_eq!(decoded, Some((request, frame.len())));
        for cut in 0..frame.len() {
            prop_assert!(matches!(protocol::decode_request(&frame[..cut]), Ok(None)), "prefix {}", cut);
        }
    }

    #[test]
    fn oversized_store_headers_fail_before_any_body(op in 1u8..=5, a in any::<u32>(), b in any::<u32>()) {
        let mut header = b"CHS1".to_vec();
        header.push(op);
        header.extend_from_slice(&a.to_le_bytes());
        header.extend_from_slice(&b.to_le_bytes());
        let (a, b) = (a as usize, b as usize);
        let oversized = match op {
            1 => a > MAX_KEY_LEN || b > MAX_VALUE_LEN,
            2 => a > MAX_KEY_LEN,
            3 => a > MAX_KEY_LEN || b != 8,
            _ => a > MAX_KEYS || b > MAX_KEYS * (4 + MAX_KEY_LEN),
        };
        if oversized {
            prop_assert!(protocol::decode_request(&header[..REQUEST_HEADER_LEN]).is_err());
        }
    }

    #[test]
    fn store_responses_never_panic(bytes in proptest::array::uniform9(any::<u8>())) {
        let header: [u8; RESPONSE_HEADER_LEN] = bytes;
        let _ = protocol::decode_response_header(&header);
    }

    #[test]
    fn handshake_answers_never_panic_or_overrun(bytes in proptest::collection::vec(any::<u8>(), 0..400), magic in any::<bool>()) {
        let mut buf = bytes;
        if magic && buf.len() >= 4 {
            buf[..4].copy_from_slice(&handshake::MAGIC);
        }
        if let Ok(Some((_, used))) = handshake::decode_answer(&buf) {
            prop_assert!(used <= buf.len() && used <= handshake::MAX_ANSWER_LEN);
        }
    }

    #[test]
    fn handshake_answers_round_trip(job in "[ -~]{0,255}", token in any::<Vec<u8>>(), nonce in any::<[u8; NONCE_LEN]>()) {
        let auth = Auth::new(job, token).unwrap();
        let frame = handshake::answer(&auth, &handshake::challenge(&nonce)).unwrap();
        let (answer, used) = handshake::decode_answer(&frame).unwrap().unwrap();
        prop_assert_eq!(used, frame.len());
        prop_assert_eq!(handshake::check(&auth, &nonce, &answer), Ok(()));
    }
}
