//! One socket to a peer: its queues of stripes to write and to read, and the reads and
//! writes that move them (the engine in `engine.rs` decides when).

use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use super::frame::{FrameHeader, HEADER_LEN};
use crate::matching::{self, MessageId};
use crate::request::Completion;
use crate::TransportError;

/// Most bytes moved on one socket before the engine turns to the next one.
const BUDGET: usize = 4 << 20;

/// Largest payload sent and received as one contiguous frame, copied through the stack:
/// send(2) and recv(2) of one buffer cost the kernel less than writev(2) and readv(2).
pub(super) const SMALL: usize = 216;

/// A stripe waiting to be written: header first, then payload.
#[derive(Debug)]
pub(super) struct SendPiece {
    pub(super) header: [u8; HEADER_LEN],
    pub(super) data: *const u8,
    pub(super) len: usize,
    pub(super) written: usize,
    pub(super) done: Arc<Completion>,
}

/// A stripe waiting to be read: header (checked), then payload.
#[derive(Debug)]
pub(super) struct RecvPiece {
    pub(super) expect: FrameHeader,
    pub(super) buf: *mut u8,
    pub(super) len: usize,
    pub(super) got: usize,
    pub(super) done: Arc<Completion>,
}

/// Where the incoming side of one socket stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Inbound {
    /// The peer may still send on it.
    Open,
    /// The peer closed it after everything it sent was read.
    Ended,
}

/// One socket to a peer.
#[derive(Debug)]
pub(super) struct Conn {
    pub(super) peer: usize,
    pub(super) stream: TcpStream,
    pub(super) sends: VecDeque<SendPiece>,
    pub(super) recvs: VecDeque<RecvPiece>,
    pub(super) header: [u8; HEADER_LEN],
    pub(super) header_got: usize,
    pub(super) inbound: Inbound,
    /// Stripes finished on this socket, both ways.
    pub(super) finished: u64,
}

impl Conn {
    pub(super) fn new(peer: usize, stream: TcpStream) -> Conn {
        Conn {
            peer,
            stream,
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            header: [0; HEADER_LEN],
            header_got: 0,
            inbound: Inbound::Open,
            finished: 0,
        }
    }

    /// Writes queued stripes until the socket is full; `Ok(false)` if the budget ran out.
    pub(super) fn flush(&mut self) -> Result<bool, TransportError> {
        let mut moved = 0;
        while let Some(piece) = self.sends.front_mut() {
            if moved >= BUDGET {
                return Ok(false);
            }
            let total = HEADER_LEN + piece.len;
            // SAFETY: `data..data+len` is valid for reads per `post_send`'s contract.
            let body = unsafe { std::slice::from_raw_parts(piece.data, piece.len) };
            let sent = if piece.written == 0 && piece.len <= SMALL {
                send_frame(&mut self.stream, &piece.header, body)
            } else {
                let (head, body_from) = if piece.written < HEADER_LEN {
                    (&piece.header[piece.written..], 0)
                } else {
                    (&[][..], piece.written - HEADER_LEN)
                };
                let bufs = [IoSlice::new(head), IoSlice::new(&body[body_from..])];
                self.stream.write_vectored(&bufs)
            };
            let n = match sent {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_error(self.peer, "send", e)),
            };
            if n == 0 && total > piece.written {
                return Err(TransportError::PeerClosed { peer: self.peer });
            }
            piece.written += n;
            moved += n;
            if piece.written == total {
                let piece = self.sends.pop_front().expect("front exists");
                self.finished += 1;
                piece.done.part_done();
            }
        }
        Ok(true)
    }

    /// Reads into posted stripes until the socket is empty; `Ok(false)` if the budget ran out.
    ///
    /// With nothing posted, only checks whether the peer has closed the socket.
    pub(super) fn pump(&mut self) -> Result<bool, TransportError> {
        if self.inbound == Inbound::Ended && !self.recvs.is_empty() {
            return Err(TransportError::PeerClosed { peer: self.peer });
        }
        if self.recvs.is_empty() {
            return self.probe_eof();
        }
        let mut moved = 0;
        while let Some(piece) = self.recvs.front_mut() {
            if moved >= BUDGET {
                return Ok(false);
            }
            // SAFETY: `buf..buf+len` is valid and exclusively ours per `post_recv`'s contract.
            let buf = unsafe { std::slice::from_raw_parts_mut(piece.buf, piece.len) };
            // The header and the payload in one read: a small message costs one syscall. Payload
            // bytes read before a header fails its check only land in a buffer whose receive fails.
            let got = if self.header_got == 0 && piece.got == 0 && piece.len <= SMALL {
                let mut frame = [0u8; HEADER_LEN + SMALL];
                let got = self.stream.read(&mut frame[..HEADER_LEN + piece.len]);
                if let Ok(n) = got {
                    let head = n.min(HEADER_LEN);
                    self.header[..head].copy_from_slice(&frame[..head]);
                    buf[..n - head].copy_from_slice(&frame[head..n]);
                }
                got
            } else {
                let mut bufs = [
                    IoSliceMut::new(&mut self.header[self.header_got..]),
                    IoSliceMut::new(&mut buf[piece.got..]),
                ];
                self.stream.read_vectored(&mut bufs)
            };
            let n = match got {
                Ok(0) => return Err(TransportError::PeerClosed { peer: self.peer }),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_error(self.peer, "recv", e)),
            };
            let to_header = n.min(HEADER_LEN - self.header_got);
            let header_done = to_header > 0 && self.header_got + to_header == HEADER_LEN;
            self.header_got += to_header;
            piece.got += n - to_header;
            moved += n;
            if header_done {
                check_header(self.peer, &self.header, &piece.expect)?;
            }
            if self.header_got == HEADER_LEN && piece.got == piece.len {
                self.header_got = 0;
                let piece = self.recvs.pop_front().expect("front exists");
                self.finished += 1;
                piece.done.part_done();
            }
        }
        Ok(true)
    }

    /// The header of the frame at the front of the socket, left there; `None` until all of it
    /// has arrived. Only meaningful with nothing posted (no frame read in part).
    pub(super) fn peek_header(&mut self) -> Result<Option<FrameHeader>, TransportError> {
        let mut bytes = [0u8; HEADER_LEN];
        match self.stream.peek(&mut bytes) {
            Ok(0) => {
                self.inbound = Inbound::Ended;
                Err(TransportError::PeerClosed { peer: self.peer })
            }
            Ok(n) if n < HEADER_LEN => Ok(None),
            Ok(_) => {
                FrameHeader::decode(&bytes)
                    .map(Some)
                    .map_err(|detail| TransportError::Protocol {
                        peer: self.peer,
                        detail,
                    })
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(io_error(self.peer, "recv", e)),
        }
    }

    /// With nothing posted, notes whether the peer closed this socket. That is only an error
    /// once a receive needs it (other sockets of the same peer may still carry the rest of a
    /// message).
    pub(super) fn probe_eof(&mut self) -> Result<bool, TransportError> {
        let mut probe = [0u8; 1];
        match self.stream.peek(&mut probe) {
            Ok(0) => {
                self.inbound = Inbound::Ended;
                Ok(true)
            }
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(true),
            Err(e) => Err(io_error(self.peer, "recv", e)),
        }
    }
}

impl Conn {
    /// How long the peer's host has acknowledged nothing while the kernel retransmits to it
    /// (`TCP_INFO`); `None` while it acknowledges, or when nothing is unacknowledged.
    pub(super) fn unanswered(&self) -> Option<Duration> {
        // SAFETY: tcp_info is plain integers, for which all zeroes is a valid value.
        let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        // SAFETY: `info` is a live tcp_info of `len` bytes for the kernel to fill; the socket
        // is open while `self` lives.
        let rc = unsafe {
            libc::getsockopt(
                self.stream.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                (&mut info as *mut libc::tcp_info).cast(),
                &mut len,
            )
        };
        (rc == 0 && info.tcpi_retransmits > 0 && info.tcpi_unacked > 0)
            .then(|| Duration::from_millis(info.tcpi_last_ack_recv.into()))
    }
}

/// Writes a frame of at most [`SMALL`] payload bytes with one send(2), header and payload
/// copied together on the stack (cheaper for the kernel than writev(2) of the two).
pub(super) fn send_frame(
    stream: &mut TcpStream,
    header: &[u8; HEADER_LEN],
    body: &[u8],
) -> io::Result<usize> {
    let total = HEADER_LEN + body.len();
    let mut frame = [0u8; HEADER_LEN + SMALL];
    frame[..HEADER_LEN].copy_from_slice(header);
    frame[HEADER_LEN..total].copy_from_slice(body);
    stream.write(&frame[..total])
}

/// Checks an arrived header against what the posted receive expects.
pub(super) fn check_header(
    peer: usize,
    bytes: &[u8; HEADER_LEN],
    expect: &FrameHeader,
) -> Result<(), TransportError> {
    let got =
        FrameHeader::decode(bytes).map_err(|detail| TransportError::Protocol { peer, detail })?;
    let id = |h: &FrameHeader| MessageId {
        seq: h.seq,
        tag: h.tag,
        len: h.msg_len,
        piece: h.stripe_len,
    };
    matching::check(peer, id(&got), id(expect))
}

/// A socket's I/O error as the transport reports it: a closed or reset connection is the
/// peer gone.
pub(super) fn io_error(peer: usize, op: &'static str, e: io::Error) -> TransportError {
    match e.kind() {
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::UnexpectedEof => TransportError::PeerClosed { peer },
        _ => TransportError::io(peer, op, None, e),
    }
}

/// A connection on one end of a socket, and the other end (blocking), for tests.
#[cfg(test)]
pub(super) fn conn_and_other_end() -> (Conn, std::net::TcpStream) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let other =
        std::net::TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
    other.set_nodelay(true).expect("nodelay");
    let (mine, _) = listener.accept().expect("accept");
    mine.set_nonblocking(true).expect("non-blocking");
    mine.set_nodelay(true).expect("nodelay");
    (Conn::new(1, mine), other)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{Direction, Request};
    use std::time::{Duration, Instant};

    /// Bytes of the frame in flight that `conn` has taken in so far.
    fn taken(conn: &Conn, frame: usize) -> usize {
        match conn.recvs.front() {
            Some(piece) => conn.header_got + piece.got,
            None => frame,
        }
    }

    #[test]
    fn a_frame_arriving_in_pieces_is_reassembled() {
        // Small and large payloads. 7-byte pieces split the header, and the first read of a
        // small frame (one recv of header and payload) as well as the later ones (readv); 45
        // bytes end that first read inside the payload; 48 bring a whole 8-byte frame at once.
        for (len, piece) in [
            (8, 7),
            (SMALL, 7),
            (SMALL + 1, 7),
            (1000, 7),
            (100, 45),
            (8, 48),
        ] {
            let (mut conn, mut writer) = conn_and_other_end();
            let header = FrameHeader {
                tag: 7,
                seq: 0,
                msg_len: len as u64,
                stripe_len: len as u64,
            };
            let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let mut buf = vec![0u8; len];
            let (req, done) = Request::new(1, Direction::Recv, len);
            conn.recvs.push_back(RecvPiece {
                expect: header,
                buf: buf.as_mut_ptr(),
                len,
                got: 0,
                done,
            });
            let mut wire = header.encode().to_vec();
            wire.extend(&payload);
            let mut sent = 0;
            for bytes in wire.chunks(piece) {
                assert!(req.test().is_none(), "{len} B done after {sent} bytes");
                writer.write_all(bytes).expect("write");
                sent += bytes.len();
                let deadline = Instant::now() + Duration::from_secs(10);
                while taken(&conn, wire.len()) < sent {
                    assert!(
                        Instant::now() < deadline,
                        "{len} B: {sent} bytes never read"
                    );
                    assert!(conn.pump().expect("pump"));
                }
                assert_eq!(
                    taken(&conn, wire.len()),
                    sent,
                    "{len} B read past what was sent"
                );
            }
            assert!(matches!(req.test(), Some(Ok(()))), "{len} B not done");
            assert_eq!(buf, payload, "{len} B payload");
        }
    }

    #[test]
    fn frames_queued_behind_a_large_one_leave_intact() {
        // The large frames fill the socket, so the small ones after them may go out in pieces
        // (a short send, then the vectored path) while the other end reads in odd sizes.
        let (mut conn, mut reader) = conn_and_other_end();
        let sizes = [3 << 20, 8, SMALL, 100, 0, 1 << 20, 40, SMALL - 1, 8];
        let payloads: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(k, &len)| (0..len).map(|i| (i * 7 + k) as u8).collect())
            .collect();
        let mut wire = Vec::new();
        let mut reqs = Vec::new();
        for (seq, payload) in payloads.iter().enumerate() {
            let len = payload.len();
            let header = FrameHeader {
                tag: 9,
                seq: seq as u64,
                msg_len: len as u64,
                stripe_len: len as u64,
            }
            .encode();
            wire.extend_from_slice(&header);
            wire.extend_from_slice(payload);
            let (req, done) = Request::new(1, Direction::Send, len);
            conn.sends.push_back(SendPiece {
                header,
                data: payload.as_ptr(),
                len,
                written: 0,
                done,
            });
            reqs.push(req);
        }
        let total = wire.len();
        let drain = std::thread::spawn(move || {
            let mut got = Vec::with_capacity(total);
            let mut buf = [0u8; 4093];
            while got.len() < total {
                let n = reader.read(&mut buf).expect("read");
                assert!(n > 0, "the sender closed after {} bytes", got.len());
                got.extend_from_slice(&buf[..n]);
            }
            got
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        while !conn.sends.is_empty() {
            assert!(
                Instant::now() < deadline,
                "{} frames never left",
                conn.sends.len()
            );
            assert!(conn.flush().expect("flush") || !conn.sends.is_empty());
            std::thread::yield_now();
        }
        assert!(
            drain.join().expect("reader") == wire,
            "the bytes on the wire differ"
        );
        for (k, req) in reqs.iter().enumerate() {
            assert!(matches!(req.test(), Some(Ok(()))), "send {k} not done");
        }
    }

    #[test]
    fn a_small_frame_cut_short_is_finished_by_the_vectored_path() {
        // What a short send(2) of a small frame leaves: `written` bytes gone, header or payload
        // partly; the rest must follow exactly.
        for written in [1, 20, HEADER_LEN, HEADER_LEN + 3] {
            let (mut conn, mut reader) = conn_and_other_end();
            let payload: Vec<u8> = (0..8).map(|i| 100 + i).collect();
            let header = FrameHeader {
                tag: 3,
                seq: 0,
                msg_len: 8,
                stripe_len: 8,
            }
            .encode();
            let (req, done) = Request::new(1, Direction::Send, 8);
            conn.sends.push_back(SendPiece {
                header,
                data: payload.as_ptr(),
                len: 8,
                written,
                done,
            });
            assert!(conn.flush().expect("flush"));
            assert!(
                matches!(req.test(), Some(Ok(()))),
                "cut at {written}: not done"
            );
            let mut wire = header.to_vec();
            wire.extend_from_slice(&payload);
            let mut rest = vec![0u8; wire.len() - written];
            reader.read_exact(&mut rest).expect("read");
            assert_eq!(rest, wire[written..], "cut at {written}");
        }
    }
}
