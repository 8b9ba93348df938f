//! The store's wire format: small binary request/response frames, validated before allocation.
//!
//! Every request starts with a 13-byte header, all integers little-endian:
//!
//! ```text
//! magic "CHS1" (4) | opcode u8 (1) | a: u32 LE (4) | b: u32 LE (4) | body
//!
//! SET   = 1   a = key length,  b = value length  body = key ++ value
//! GET   = 2   a = key length,  b = 0             body = key
//! ADD   = 3   a = key length,  b = 8             body = key ++ delta (i64 LE)
//! WAIT  = 4   a = key count,   b = body length   body = key count × (u32 LE length ++ key)
//! CHECK = 5   a = key count,   b = body length   body = as WAIT
//! HOLD  = 6   a = key length,  b = value length  body = key ++ value (both at most MAX_KEY_LEN)
//! ```
//!
//! HOLD asks the server to set `key` to `value` when this connection closes, unless `key` is
//! set by then; a later HOLD on the connection replaces it, and one with an empty key drops it.
//!
//! Every response starts with a 9-byte header:
//!
//! ```text
//! magic "CHS1" (4) | status u8 (1) | payload length u32 LE (4) | payload
//!
//! status OK = 0     payload: SET/WAIT/HOLD empty, GET the value, ADD the new value (i64 LE),
//!                   CHECK one byte per requested key (1 = set, 0 = missing)
//! status ERROR = 1  payload: UTF-8 message (e.g. ADD on a value that is not an integer)
//! ```
//!
//! Keys are UTF-8, at most [`MAX_KEY_LEN`] bytes; values at most [`MAX_VALUE_LEN`] bytes;
//! WAIT/CHECK name at most [`MAX_KEYS`] keys. A header breaking any rule is rejected as soon
//! as it arrives, before any of its body is buffered.

use super::StoreError;

/// The four bytes that open every frame, in both directions ("CHorus Store", version 1).
pub const MAGIC: [u8; 4] = *b"CHS1";
/// The largest key, in bytes.
pub const MAX_KEY_LEN: usize = 4096;
/// The largest value, in bytes.
pub const MAX_VALUE_LEN: usize = 64 << 20;
/// The most keys one WAIT or CHECK request may name.
pub const MAX_KEYS: usize = 65_536;
/// Size of a request header.
pub const REQUEST_HEADER_LEN: usize = 13;
/// Size of a response header.
pub const RESPONSE_HEADER_LEN: usize = 9;
/// The largest request frame a valid peer can send.
pub const MAX_REQUEST_LEN: usize = REQUEST_HEADER_LEN + MAX_KEY_LEN + MAX_VALUE_LEN;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_WAIT: u8 = 4;
const OP_CHECK: u8 = 5;
const OP_HOLD: u8 = 6;

/// Response status: the request succeeded.
pub const STATUS_OK: u8 = 0;
/// Response status: the request was understood but refused; the payload says why.
pub const STATUS_ERROR: u8 = 1;

/// A decoded request, as the server sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Set `key` to `value`.
    Set {
        /// The key.
        key: String,
        /// The new value.
        value: Vec<u8>,
    },
    /// Return the value of `key`, once it is set.
    Get {
        /// The key.
        key: String,
    },
    /// Add `delta` to the integer at `key`.
    Add {
        /// The key.
        key: String,
        /// The amount to add.
        delta: i64,
    },
    /// Answer once every key is set.
    Wait {
        /// The keys.
        keys: Vec<String>,
    },
    /// Answer at once which keys are set.
    Check {
        /// The keys.
        keys: Vec<String>,
    },
    /// Set `key` to `value` when this connection closes, unless it is set by then (`None`:
    /// drop the connection's hold).
    Hold {
        /// The key and its value.
        hold: Option<(String, Vec<u8>)>,
    },
}

/// Encodes a SET request.
pub fn encode_set(key: &str, value: &[u8]) -> Vec<u8> {
    let mut frame = request_header(OP_SET, key.len(), value.len());
    frame.extend_from_slice(key.as_bytes());
    frame.extend_from_slice(value);
    frame
}

/// Encodes a GET request.
pub fn encode_get(key: &str) -> Vec<u8> {
    let mut frame = request_header(OP_GET, key.len(), 0);
    frame.extend_from_slice(key.as_bytes());
    frame
}

/// Encodes an ADD request.
pub fn encode_add(key: &str, delta: i64) -> Vec<u8> {
    let mut frame = request_header(OP_ADD, key.len(), 8);
    frame.extend_from_slice(key.as_bytes());
    frame.extend_from_slice(&delta.to_le_bytes());
    frame
}

/// Encodes a HOLD request (an empty `key` drops the connection's hold).
pub fn encode_hold(key: &str, value: &[u8]) -> Vec<u8> {
    let mut frame = request_header(OP_HOLD, key.len(), value.len());
    frame.extend_from_slice(key.as_bytes());
    frame.extend_from_slice(value);
    frame
}

/// Encodes a WAIT request.
pub fn encode_wait(keys: &[&str]) -> Vec<u8> {
    encode_key_list(OP_WAIT, keys)
}

/// Encodes a CHECK request.
pub fn encode_check(keys: &[&str]) -> Vec<u8> {
    encode_key_list(OP_CHECK, keys)
}

fn encode_key_list(op: u8, keys: &[&str]) -> Vec<u8> {
    let body_len: usize = keys.iter().map(|k| 4 + k.len()).sum();
    let mut frame = request_header(op, keys.len(), body_len);
    for key in keys {
        frame.extend_from_slice(&len_u32(key.len()).to_le_bytes());
        frame.extend_from_slice(key.as_bytes());
    }
    frame
}

fn request_header(op: u8, a: usize, b: usize) -> Vec<u8> {
    let mut frame = Vec::with_capacity(REQUEST_HEADER_LEN + a + b);
    frame.extend_from_slice(&MAGIC);
    frame.push(op);
    frame.extend_from_slice(&len_u32(a).to_le_bytes());
    frame.extend_from_slice(&len_u32(b).to_le_bytes());
    frame
}

/// Lengths are checked against the limits before encoding, so they always fit in a u32.
fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// Encodes a response frame.
pub fn encode_response(status: u8, payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(RESPONSE_HEADER_LEN + payload.len());
    frame.extend_from_slice(&MAGIC);
    frame.push(status);
    frame.extend_from_slice(&len_u32(payload.len()).to_le_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// Checks that a client-side key is within the protocol's limits.
///
/// Fails with [`StoreError::Protocol`] when it is longer than [`MAX_KEY_LEN`].
pub fn check_key(key: &str) -> Result<(), StoreError> {
    if key.len() > MAX_KEY_LEN {
        return Err(protocol(format!(
            "key of {} bytes exceeds the {MAX_KEY_LEN}-byte limit",
            key.len()
        )));
    }
    Ok(())
}

/// Checks that a client-side value is within the protocol's limits.
///
/// Fails with [`StoreError::Protocol`] when it is longer than [`MAX_VALUE_LEN`].
pub fn check_value(value: &[u8]) -> Result<(), StoreError> {
    if value.len() > MAX_VALUE_LEN {
        return Err(protocol(format!(
            "value of {} bytes exceeds the {MAX_VALUE_LEN}-byte limit",
            value.len()
        )));
    }
    Ok(())
}

/// Checks a client-side key list (count, each key, total size) against the limits.
///
/// Fails with [`StoreError::Protocol`] when any limit is broken.
pub fn check_keys(keys: &[&str]) -> Result<(), StoreError> {
    if keys.len() > MAX_KEYS {
        return Err(protocol(format!(
            "{} keys exceed the {MAX_KEYS}-key limit",
            keys.len()
        )));
    }
    keys.iter().try_for_each(|key| check_key(key))?;
    let body_len: usize = keys.iter().map(|k| 4 + k.len()).sum();
    if body_len > MAX_VALUE_LEN {
        return Err(protocol(format!(
            "key list of {body_len} bytes is too large"
        )));
    }
    Ok(())
}

/// Decodes the first request in `buf`: `Ok(None)` while it is incomplete, else the request and
/// the bytes it used.
///
/// Fails with [`StoreError::Protocol`] as soon as the bytes present break the format (wrong
/// magic, unknown opcode, a length over its limit, a key that is not UTF-8).
pub fn decode_request(buf: &[u8]) -> Result<Option<(Request, usize)>, StoreError> {
    check_magic_prefix(buf)?;
    let Some(header) = buf.get(..REQUEST_HEADER_LEN) else {
        if let Some(&op) = buf.get(4) {
            check_opcode(op)?;
        }
        return Ok(None);
    };
    let (op, a, b) = parse_request_header(header)?;
    let body_len = body_len(op, a, b);
    let Some(body) = buf.get(REQUEST_HEADER_LEN..REQUEST_HEADER_LEN + body_len) else {
        return Ok(None);
    };
    let request = decode_body(op, a, body)?;
    Ok(Some((request, REQUEST_HEADER_LEN + body_len)))
}

fn check_magic_prefix(buf: &[u8]) -> Result<(), StoreError> {
    let n = buf.len().min(MAGIC.len());
    if buf[..n] != MAGIC[..n] {
        return Err(protocol(format!("bad magic {:02x?}", &buf[..n])));
    }
    Ok(())
}

fn check_opcode(op: u8) -> Result<(), StoreError> {
    match op {
        OP_SET | OP_GET | OP_ADD | OP_WAIT | OP_CHECK | OP_HOLD => Ok(()),
        _ => Err(protocol(format!("unknown opcode {op}"))),
    }
}

/// Validates a full request header; returns the opcode and its two lengths.
fn parse_request_header(header: &[u8]) -> Result<(u8, usize, usize), StoreError> {
    let op = header[4];
    check_opcode(op)?;
    let a = read_u32(&header[5..9]);
    let b = read_u32(&header[9..13]);
    let valid = match op {
        OP_SET => a <= MAX_KEY_LEN && b <= MAX_VALUE_LEN,
        OP_GET => a <= MAX_KEY_LEN && b == 0,
        OP_ADD => a <= MAX_KEY_LEN && b == 8,
        OP_HOLD => a <= MAX_KEY_LEN && b <= MAX_KEY_LEN,
        _ => a <= MAX_KEYS && b >= 4 * a && b <= a * (4 + MAX_KEY_LEN) && b <= MAX_VALUE_LEN,
    };
    if !valid {
        return Err(protocol(format!(
            "opcode {op} with invalid lengths {a} and {b}"
        )));
    }
    Ok((op, a, b))
}

fn body_len(op: u8, a: usize, b: usize) -> usize {
    match op {
        OP_WAIT | OP_CHECK => b,
        _ => a + b,
    }
}

fn decode_body(op: u8, a: usize, body: &[u8]) -> Result<Request, StoreError> {
    Ok(match op {
        OP_SET => Request::Set {
            key: decode_key(&body[..a])?,
            value: body[a..].to_vec(),
        },
        OP_GET => Request::Get {
            key: decode_key(body)?,
        },
        OP_ADD => Request::Add {
            key: decode_key(&body[..a])?,
            delta: i64::from_le_bytes(body[a..].try_into().unwrap_or([0; 8])),
        },
        OP_WAIT => Request::Wait {
            keys: decode_key_list(a, body)?,
        },
        OP_HOLD => Request::Hold {
            hold: match a {
                0 => None,
                _ => Some((decode_key(&body[..a])?, body[a..].to_vec())),
            },
        },
        _ => Request::Check {
            keys: decode_key_list(a, body)?,
        },
    })
}

/// Decodes `count` length-prefixed keys that must fill `body` exactly.
fn decode_key_list(count: usize, body: &[u8]) -> Result<Vec<String>, StoreError> {
    // The header check guarantees body.len() >= 4 * count, so this allocation is bounded by
    // bytes actually received.
    let mut keys = Vec::with_capacity(count);
    let mut rest = body;
    for _ in 0..count {
        let (len, tail) = rest.split_at_checked(4).ok_or_else(truncated_list)?;
        let len = read_u32(len);
        if len > MAX_KEY_LEN {
            return Err(protocol(format!(
                "listed key of {len} bytes exceeds the limit"
            )));
        }
        let (key, tail) = tail.split_at_checked(len).ok_or_else(truncated_list)?;
        keys.push(decode_key(key)?);
        rest = tail;
    }
    if !rest.is_empty() {
        return Err(protocol(format!(
            "{} stray bytes after the key list",
            rest.len()
        )));
    }
    Ok(keys)
}

fn truncated_list() -> StoreError {
    protocol("key list is shorter than its header says".to_string())
}

fn decode_key(bytes: &[u8]) -> Result<String, StoreError> {
    String::from_utf8(bytes.to_vec()).map_err(|_| protocol("key is not UTF-8".to_string()))
}

/// Validates a response header; returns its status and payload length.
///
/// Fails with [`StoreError::Protocol`] on a wrong magic, an unknown status or an oversized
/// payload.
pub fn decode_response_header(
    header: &[u8; RESPONSE_HEADER_LEN],
) -> Result<(u8, usize), StoreError> {
    if header[..4] != MAGIC {
        return Err(protocol(format!(
            "bad response magic {:02x?}",
            &header[..4]
        )));
    }
    let status = header[4];
    if status != STATUS_OK && status != STATUS_ERROR {
        return Err(protocol(format!("unknown response status {status}")));
    }
    let len = read_u32(&header[5..9]);
    if len > MAX_VALUE_LEN {
        return Err(protocol(format!(
            "response payload of {len} bytes exceeds the limit"
        )));
    }
    Ok((status, len))
}

fn read_u32(bytes: &[u8]) -> usize {
    let mut raw = [0u8; 4];
    raw.copy_from_slice(bytes);
    u32::from_le_bytes(raw) as usize
}

fn protocol(message: String) -> StoreError {
    StoreError::Protocol(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_requests() -> Vec<(Vec<u8>, Request)> {
        vec![
            (
                encode_set("a/b", b"value"),
                Request::Set {
                    key: "a/b".into(),
                    value: b"value".to_vec(),
                },
            ),
            (encode_get("k"), Request::Get { key: "k".into() }),
            (
                encode_add("n", -7),
                Request::Add {
                    key: "n".into(),
                    delta: -7,
                },
            ),
            (
                encode_wait(&["x", "", "zz"]),
                Request::Wait {
                    keys: vec!["x".into(), "".into(), "zz".into()],
                },
            ),
            (encode_check(&[]), Request::Check { keys: vec![] }),
            (
                encode_hold("gone", b"rank 1 left"),
                Request::Hold {
                    hold: Some(("gone".into(), b"rank 1 left".to_vec())),
                },
            ),
            (encode_hold("", b""), Request::Hold { hold: None }),
        ]
    }

    #[test]
    fn every_request_round_trips() {
        for (frame, expected) in all_requests() {
            let (decoded, used) = decode_request(&frame).unwrap().unwrap();
            assert_eq!(decoded, expected);
            assert_eq!(used, frame.len());
        }
    }

    #[test]
    fn every_strict_prefix_is_incomplete() {
        for (frame, _) in all_requests() {
            for end in 0..frame.len() {
                assert_eq!(decode_request(&frame[..end]).unwrap(), None, "prefix {end}");
            }
        }
    }

    #[test]
    fn decodes_only_the_first_of_two_frames() {
        let mut buf = encode_get("first");
        let first_len = buf.len();
        buf.extend_from_slice(&encode_get("second"));
        let (request, used) = decode_request(&buf).unwrap().unwrap();
        assert_eq!(
            request,
            Request::Get {
                key: "first".into()
            }
        );
        assert_eq!(used, first_len);
    }

    #[test]
    fn wrong_magic_is_rejected_from_the_first_byte() {
        assert!(matches!(decode_request(b"X"), Err(StoreError::Protocol(_))));
        assert!(matches!(
            decode_request(b"CHSX"),
            Err(StoreError::Protocol(_))
        ));
    }

    #[test]
    fn unknown_opcode_is_rejected_before_the_lengths() {
        assert!(matches!(
            decode_request(b"CHS1\x09"),
            Err(StoreError::Protocol(_))
        ));
    }

    #[test]
    fn oversized_lengths_are_rejected_from_the_header_alone() {
        let long_hold = header(OP_HOLD, 4, MAX_KEY_LEN as u32 + 1);
        assert!(matches!(
            decode_request(&long_hold),
            Err(StoreError::Protocol(_))
        ));
        let huge_key = header(OP_SET, MAX_KEY_LEN as u32 + 1, 0);
        let huge_value = header(OP_SET, 1, MAX_VALUE_LEN as u32 + 1);
        let max_everything = header(OP_SET, u32::MAX, u32::MAX);
        let get_with_value = header(OP_GET, 1, 1);
        let add_without_delta = header(OP_ADD, 1, 4);
        let too_many_keys = header(OP_WAIT, MAX_KEYS as u32 + 1, u32::MAX);
        let list_too_short = header(OP_WAIT, 3, 11);
        for frame in [
            huge_key,
            huge_value,
            max_everything,
            get_with_value,
            add_without_delta,
            too_many_keys,
            list_too_short,
        ] {
            assert!(matches!(
                decode_request(&frame),
                Err(StoreError::Protocol(_))
            ));
        }
    }

    #[test]
    fn inconsistent_key_lists_are_rejected() {
        // One key claiming 10 bytes inside a 6-byte body.
        let mut frame = header(OP_WAIT, 1, 6);
        frame.extend_from_slice(&10u32.to_le_bytes());
        frame.extend_from_slice(b"ab");
        assert!(matches!(
            decode_request(&frame),
            Err(StoreError::Protocol(_))
        ));
        // One 1-byte key followed by stray bytes.
        let mut frame = header(OP_CHECK, 1, 8);
        frame.extend_from_slice(&1u32.to_le_bytes());
        frame.extend_from_slice(b"abcd");
        assert!(matches!(
            decode_request(&frame),
            Err(StoreError::Protocol(_))
        ));
    }

    #[test]
    fn non_utf8_keys_are_rejected() {
        let mut frame = header(OP_GET, 2, 0);
        frame.extend_from_slice(&[0xff, 0xfe]);
        assert!(matches!(
            decode_request(&frame),
            Err(StoreError::Protocol(_))
        ));
    }

    #[test]
    fn response_headers_are_validated() {
        let ok = encode_response(STATUS_OK, b"abc");
        let header: [u8; RESPONSE_HEADER_LEN] = ok[..RESPONSE_HEADER_LEN].try_into().unwrap();
        assert_eq!(decode_response_header(&header).unwrap(), (STATUS_OK, 3));

        let mut bad_status = header;
        bad_status[4] = 7;
        assert!(decode_response_header(&bad_status).is_err());
        let mut huge = header;
        huge[5..9].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_response_header(&huge).is_err());
        let mut bad_magic = header;
        bad_magic[0] = b'X';
        assert!(decode_response_header(&bad_magic).is_err());
    }

    #[test]
    fn client_side_limits() {
        assert!(check_key(&"k".repeat(MAX_KEY_LEN)).is_ok());
        assert!(check_key(&"k".repeat(MAX_KEY_LEN + 1)).is_err());
        assert!(check_value(&vec![0; MAX_VALUE_LEN + 1]).is_err());
        assert!(check_keys(&["a"; MAX_KEYS + 1]).is_err());
    }

    fn header(op: u8, a: u32, b: u32) -> Vec<u8> {
        let mut frame = MAGIC.to_vec();
        frame.push(op);
        frame.extend_from_slice(&a.to_le_bytes());
        frame.extend_from_slice(&b.to_le_bytes());
        frame
    }
}
