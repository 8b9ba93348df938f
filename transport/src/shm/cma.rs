//! Single-copy transfers: the receiver reads a large message straight out of
//! the sender's memory with `process_vm_readv` (cross-memory attach), instead
//! of the sender copying it into a slot and the receiver copying it out.
//!
//! Needs ptrace-level access to the peer (same user, no Yama restriction);
//! set-up probes it and falls back to copying through slots where it fails.

use std::io;

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
    let read = unsafe { read_remote(pid, probe, std::ptr::addr_of_mut!(got).cast(), 8) };
    read.is_ok() && got == PROBE
}

/// Copies `len` bytes at `addr` in process `pid` to `dst`.
///
/// # Safety
///
/// `dst..dst+len` must be valid for writes and not otherwise in use.
pub(crate) unsafe fn read_remote(pid: u32, addr: u64, dst: *mut u8, len: usize) -> io::Result<()> {
    let mut done = 0;
    while done < len {
        let local = libc::iovec {
            // SAFETY: `done < len`, inside the caller's buffer.
            iov_base: unsafe { dst.add(done) }.cast(),
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (addr as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: one local iovec inside the caller's buffer; the remote one
        // is only read by the kernel, which checks it against the peer's map.
        let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_its_own_probe_and_memory() {
        assert!(can_read(std::process::id(), probe_address()));
        let src: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; src.len()];
        // SAFETY: `dst` is a valid buffer of the same length.
        unsafe {
            read_remote(
                std::process::id(),
                src.as_ptr() as u64,
                dst.as_mut_ptr(),
                dst.len(),
            )
        }
        .unwrap();
        assert_eq!(src, dst);
        assert!(!can_read(std::process::id(), probe_address() + 1));
    }
}
