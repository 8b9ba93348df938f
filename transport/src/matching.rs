//! What a receiver checks before it takes a message's bytes, in every transport.

use crate::TransportError;

/// How a message presents itself, or what the posted receive expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MessageId {
    /// Position in the pair's stream of messages.
    pub seq: u64,
    /// The sender's tag.
    pub tag: u64,
    /// The whole message's length in bytes.
    pub len: u64,
    /// This piece's length (a stripe, a chunk) in bytes.
    pub piece: u64,
}

/// Fails with a `Protocol` error naming `peer` and both values unless `got` is what `want` expects.
pub(crate) fn check(peer: usize, got: MessageId, want: MessageId) -> Result<(), TransportError> {
    let protocol = |detail: String| Err(TransportError::Protocol { peer, detail });
    check_seq(peer, got.seq, want.seq)?;
    if got.tag != want.tag {
        return protocol(format!(
            "message {} has tag {:#x}, expected {:#x}: the ranks are running different operations",
            got.seq, got.tag, want.tag
        ));
    }
    if got.len != want.len || got.piece != want.piece {
        return protocol(format!(
            "message {} is {} bytes, expected {} bytes: do all ranks pass buffers of the same length?",
            got.seq, got.len, want.len
        ));
    }
    Ok(())
}

/// Fails with a `Protocol` error naming `peer` unless message `got` arrived where `want` is next.
pub(crate) fn check_seq(peer: usize, got: u64, want: u64) -> Result<(), TransportError> {
    if got != want {
        return Err(TransportError::Protocol {
            peer,
            detail: format!(
                "message sequence {got} arrived where {want} was expected (stream out of step)"
            ),
        });
    }
    Ok(())
}
