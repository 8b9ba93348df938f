//! The wire format of the TCP transport: frame headers and how a message is
//! striped over a peer's sockets.
//!
//! A message of `len` bytes becomes one frame per stripe. Each frame is a
//! fixed header followed by the stripe's payload. Both sides derive the same
//! stripe layout from (message sequence number, length, socket count), so a
//! receiver knows which socket carries which bytes before anything arrives,
//! and reads every payload straight into the destination buffer.

use std::ops::Range;

/// Marks the start of every frame ("CHR1").
pub const MAGIC: u32 = u32::from_le_bytes(*b"CHR1");

/// Size of an encoded [`FrameHeader`] in bytes.
pub const HEADER_LEN: usize = 40;

/// The header in front of every stripe's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The sender's tag for the message.
    pub tag: u64,
    /// The message's sequence number on this pair of ranks.
    pub seq: u64,
    /// The whole message's length in bytes.
    pub msg_len: u64,
    /// This stripe's payload length in bytes.
    pub stripe_len: u64,
}

impl FrameHeader {
    /// Encodes the header in little-endian order.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        // Bytes 4..8 are reserved (zero) for flags.
        out[8..16].copy_from_slice(&self.tag.to_le_bytes());
        out[16..24].copy_from_slice(&self.seq.to_le_bytes());
        out[24..32].copy_from_slice(&self.msg_len.to_le_bytes());
        out[32..40].copy_from_slice(&self.stripe_len.to_le_bytes());
        out
    }

    /// Decodes a header; fails on a wrong magic number or reserved bits set.
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<FrameHeader, String> {
        let word = |r: Range<usize>| u64::from_le_bytes(bytes[r].try_into().expect("8 bytes"));
        let magic = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"));
        if magic != MAGIC {
            return Err(format!(
                "bad frame magic {magic:#010x} (expected {MAGIC:#010x}): not a Chorus peer, or the stream is out of step"
            ));
        }
        if bytes[4..8] != [0; 4] {
            return Err("reserved header bits set: peer runs an incompatible version".into());
        }
        Ok(FrameHeader {
            tag: word(8..16),
            seq: word(16..24),
            msg_len: word(24..32),
            stripe_len: word(32..40),
        })
    }
}

/// One stripe of a message: which socket carries it and which bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stripe {
    /// Index of the socket (within the peer's sockets).
    pub socket: usize,
    /// Byte range within the message.
    pub range: Range<usize>,
}

/// The socket (of `nsocks`) that carries message `seq`'s first stripe, whatever its length.
pub fn first_socket(seq: u64, nsocks: usize) -> usize {
    // One socket (the default) needs no division: this runs for every message.
    match nsocks {
        0 | 1 => 0,
        _ => (seq % nsocks as u64) as usize,
    }
}

/// Splits message `seq` of `len` bytes over `nsocks` sockets.
///
/// Messages shorter than `2 * min_stripe` travel whole on one socket; longer
/// ones are split into at most `nsocks` near-equal stripes of at least
/// `min_stripe` bytes (itself at least 64), 64-byte aligned. The first stripe's socket rotates
/// with `seq` so consecutive small messages spread over all sockets.
pub fn stripes(
    seq: u64,
    len: usize,
    nsocks: usize,
    min_stripe: usize,
) -> impl ExactSizeIterator<Item = Stripe> {
    let nsocks = nsocks.max(1);
    let first = first_socket(seq, nsocks);
    let count = match nsocks {
        1 => 1,
        _ => (len / min_stripe.max(64)).clamp(1, nsocks),
    };
    let base = if count == 1 { len } else { (len / count) & !63 };
    (0..count).map(move |i| {
        let start = i * base;
        let end = if i + 1 == count { len } else { start + base };
        Stripe {
            // `first < nsocks` and `i < count <= nsocks`: one subtraction wraps it.
            socket: if first + i >= nsocks {
                first + i - nsocks
            } else {
                first + i
            },
            range: start..end,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = FrameHeader {
            tag: 0xdead_beef_0102,
            seq: 7,
            msg_len: 1 << 40,
            stripe_len: 12345,
        };
        assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn header_rejects_garbage() {
        let mut bytes = FrameHeader {
            tag: 1,
            seq: 2,
            msg_len: 3,
            stripe_len: 3,
        }
        .encode();
        bytes[5] = 1;
        assert!(FrameHeader::decode(&bytes)
            .unwrap_err()
            .contains("reserved"));
        bytes[0] ^= 0xff;
        assert!(FrameHeader::decode(&bytes).unwrap_err().contains("magic"));
    }

    #[test]
    fn stripes_cover_the_message_exactly() {
        for nsocks in 1..=5 {
            for len in [
                0,
                1,
                63,
                64,
                1000,
                65536,
                1 << 20,
                (1 << 20) + 7,
                10_000_019,
            ] {
                for seq in 0..6 {
                    let s: Vec<Stripe> = stripes(seq, len, nsocks, 4096).collect();
                    assert!(!s.is_empty() && s.len() <= nsocks);
                    assert_eq!(s[0].range.start, 0);
                    // A receiver finds the header of the next message here before knowing its length.
                    assert_eq!(s[0].socket, first_socket(seq, nsocks));
                    assert_eq!(s.last().unwrap().range.end, len);
                    for w in s.windows(2) {
                        assert_eq!(w[0].range.end, w[1].range.start);
                        assert_ne!(w[0].socket, w[1].socket);
                    }
                    assert!(s.iter().all(|st| st.socket < nsocks));
                }
            }
        }
    }

    #[test]
    fn small_messages_rotate_over_sockets() {
        let sockets: Vec<usize> = (0..4)
            .map(|seq| stripes(seq, 8, 4, 4096).next().unwrap().socket)
            .collect();
        assert_eq!(sockets, vec![0, 1, 2, 3]);
        assert_eq!(stripes(0, 1 << 20, 4, 4096).len(), 4);
    }
}
