//! Single-copy transfers: the receiver reads a large message straight out of
//! the sender's memory with `process_vm_readv` (cross-memory attach), instead
//! of the sender copying it into a slot and the receiver copying it out. A
//! sender with nothing else to do writes some of the pieces into the
//! receiver's memory meanwhile (`process_vm_writev`), so two cores copy.
//!
//! Needs ptrace-level access to the peer (same user, no Yama restriction);
//! set-up probes it and falls back to copying through slots where it fails.

use std::io;

use super::region::Split;

#[cfg(test)]
thread_local! {
    /// Tests: the number of this thread's next reads the last of which fails (`EPERM`).
    pub(crate) static FAIL_READ_AFTER: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// A value at a fixed address in every process, read by peers to probe access.
static PROBE: u64 = u64::from_le_bytes(*b"CHRPROBE");

/// The address of this process's probe value.
pub(crate) fn probe_address() -> u64 {
    std::ptr::addr_of!(PROBE) as u64
}

/// Whether this process can read process `pid`'s memory at `probe` (its probe value).
pub(crate) fn can_read(pid: u32, probe: u64) -> bool {
    let mut got = 0u64;
    // SAFETY: `got` is a valid, writable 8-byte local buffer.
    let read = unsafe { copy(pid, Way::Read, probe, std::ptr::addr_of_mut!(got).cast(), 8) };
    read.is_ok() && got == PROBE
}

/// Which way a cross-memory copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Way {
    /// From the peer's memory into ours (`process_vm_readv`).
    Read,
    /// From our memory into the peer's (`process_vm_writev`).
    Write,
}

/// Copies `len` bytes between `local` here and `remote` in process `pid`.
///
/// # Safety
///
/// `local..local+len` must be valid for reads (`Write`) or writes (`Read`),
/// and, for `Read`, not otherwise in use.
pub(crate) unsafe fn copy(
    pid: u32,
    way: Way,
    remote: u64,
    local: *mut u8,
    len: usize,
) -> io::Result<()> {
    #[cfg(test)]
    if way == Way::Read && FAIL_READ_AFTER.get() > 0 {
        FAIL_READ_AFTER.set(FAIL_READ_AFTER.get() - 1);
        if FAIL_READ_AFTER.get() == 0 {
            return Err(io::Error::from_raw_os_error(libc::EPERM));
        }
    }
    let mut done = 0;
    while done < len {
        let here = libc::iovec {
            // SAFETY: `done < len`, inside the caller's buffer.
            iov_base: unsafe { local.add(done) }.cast(),
            iov_len: len - done,
        };
        let there = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: one local iovec inside the caller's buffer; the kernel
        // checks the remote one against the peer's map.
        let n = unsafe {
            match way {
                Way::Read => libc::process_vm_readv(pid as libc::pid_t, &here, 1, &there, 1, 0),
                Way::Write => libc::process_vm_writev(pid as libc::pid_t, &here, 1, &there, 1, 0),
            }
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// Fewest bytes in a piece of a single-copy message (a piece is what one side
/// takes at a time). A pipeline chunk of 512 KiB goes in two: in 64 KiB pieces
/// the pinning of each copy's pages cost a W=4 all-reduce of 64 MiB a tenth of
/// its speed, and one of 1 MiB a fifth.
pub(crate) const PIECE: usize = 256 << 10;

/// Most bytes in a piece: every copy pins and unpins its pages, which costs
/// about as much as copying 64 KiB, so big messages go in big pieces.
const PIECE_MAX: usize = 4 << 20;

/// Bytes per piece of a `len`-byte message: about an eighth of it, so both
/// sides get several, between [`PIECE`] and 4 MiB, whole pages. Both sides
/// derive it from the length alone.
pub(crate) fn piece_len(len: usize) -> usize {
    (len / 8).clamp(PIECE, PIECE_MAX) & !(4096 - 1)
}

/// Pieces of a `len`-byte message.
pub(crate) fn pieces(len: usize) -> u64 {
    len.div_ceil(piece_len(len)) as u64
}

/// Takes pieces of a `len`-byte message from `split` and copies each between
/// `local` and `remote` (the same offsets of the message on both sides)
/// until none is left; returns how many this side copied.
///
/// A piece whose copy fails is still settled (nobody copies it any more),
/// flagged as the sender's failure for `Way::Write`, and the error returned.
///
/// # Safety
///
/// As [`copy`] for the whole message at `local`; the other side takes its
/// pieces from the same `split`, so no piece is copied twice.
pub(crate) unsafe fn take_pieces(
    split: Split<'_>,
    pid: u32,
    way: Way,
    remote: u64,
    local: *mut u8,
    len: usize,
) -> io::Result<u64> {
    let (total, piece_len) = (pieces(len), piece_len(len));
    let mut copied = 0;
    while let Some(piece) = split.take(total) {
        let at = piece as usize * piece_len;
        let n = piece_len.min(len - at);
        // SAFETY: `at + n <= len`, inside the caller's buffer; the piece is
        // this side's alone (taken above).
        let done = unsafe { copy(pid, way, remote + at as u64, local.add(at), n) };
        split.settle(done.is_err() && way == Way::Write);
        done?;
        copied += 1;
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use super::*;

    #[test]
    fn reads_its_own_probe_and_memory() {
        assert!(can_read(std::process::id(), probe_address()));
        let src: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; src.len()];
        // SAFETY: `dst` is a valid buffer of the same length.
        unsafe {
            copy(
                std::process::id(),
                Way::Read,
                src.as_ptr() as u64,
                dst.as_mut_ptr(),
                dst.len(),
            )
        }
        .unwrap();
        assert_eq!(src, dst);
        assert!(!can_read(std::process::id(), probe_address() + 1));
    }

    fn split(w: &[AtomicU64; 3]) -> Split<'_> {
        Split {
            dst: &w[0],
            taken: &w[1],
            settled: &w[2],
        }
    }

    fn words() -> [AtomicU64; 3] {
        [0, 0, 0].map(AtomicU64::new)
    }

    #[test]
    fn each_side_copies_only_the_pieces_it_takes() {
        let len = 5 * PIECE + 123;
        let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; len];
        let pid = std::process::id();
        // The sender writes from piece 2 on, as if the receiver had taken 0 and 1.
        let sender = words();
        sender[1].store(2, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: `src` and `dst` are valid buffers of `len` bytes.
        let wrote = unsafe {
            take_pieces(
                split(&sender),
                pid,
                Way::Write,
                dst.as_ptr() as u64,
                src.as_ptr().cast_mut(),
                len,
            )
        };
        assert_eq!(wrote.unwrap(), 4);
        assert_eq!(split(&sender).progress(), (4, false));
        assert!(
            dst[..2 * PIECE].iter().all(|&b| b == 0),
            "pieces 0 and 1 were not the sender's"
        );
        assert_eq!(dst[2 * PIECE..], src[2 * PIECE..]);
        // The receiver reads the two pieces it took.
        let receiver = words();
        // SAFETY: as above, for the first two pieces.
        let read = unsafe {
            take_pieces(
                split(&receiver),
                pid,
                Way::Read,
                src.as_ptr() as u64,
                dst.as_mut_ptr(),
                2 * PIECE,
            )
        };
        assert_eq!(read.unwrap(), 2);
        assert_eq!(dst, src);
        assert_eq!(pieces(len), 6);
        assert_eq!(pieces(0), 0);
    }

    #[test]
    fn big_messages_go_in_fewer_bigger_pieces_of_whole_pages() {
        assert_eq!(piece_len(1), PIECE);
        assert_eq!(piece_len(512 << 10), PIECE);
        assert_eq!(piece_len(8 << 20), 1 << 20);
        assert_eq!(piece_len(64 << 20), 4 << 20);
        assert_eq!(pieces(64 << 20), 16);
        for len in [1, PIECE + 1, (3 << 20) + 5, (100 << 20) + 4095] {
            let piece = piece_len(len);
            assert_eq!(piece % 4096, 0, "{len}");
            assert!(pieces(len) as usize * piece >= len, "{len}");
            assert!((pieces(len) as usize - 1) * piece < len, "{len}");
        }
    }

    #[test]
    fn a_failed_write_is_settled_and_flagged_and_a_closed_message_yields_nothing() {
        let len = 3 * PIECE;
        let src = vec![7u8; len];
        let mut dst = vec![0u8; len];
        let pid = std::process::id();
        let w = words();
        // The sender's first piece goes to an address nobody maps.
        // SAFETY: `src` is valid for `len` bytes; the remote side is checked by the kernel.
        let wrote =
            unsafe { take_pieces(split(&w), pid, Way::Write, 8, src.as_ptr().cast_mut(), len) };
        assert!(wrote.is_err());
        assert_eq!(split(&w).progress(), (1, true));
        // The receiver takes the other two; the message counts as settled.
        // SAFETY: `dst` is valid for `len` bytes.
        let read = unsafe {
            take_pieces(
                split(&w),
                pid,
                Way::Read,
                src.as_ptr() as u64,
                dst.as_mut_ptr(),
                len,
            )
        };
        assert_eq!(read.unwrap(), 2);
        assert_eq!(split(&w).progress(), (3, true));
        assert!(dst[..PIECE].iter().all(|&b| b == 0));
        assert!(dst[PIECE..].iter().all(|&b| b == 7));
        // Once closed, nobody takes a piece again, however often asked.
        let fresh = words();
        assert_eq!(split(&fresh).take(3), Some(0));
        assert_eq!(split(&fresh).close(3), 1);
        for _ in 0..3 {
            assert_eq!(split(&fresh).take(3), None);
        }
    }
}
