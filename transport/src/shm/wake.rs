//! Sleeping and waking across processes (futexes on words in the shared
//! mapping), and noticing that a peer process died (pidfds).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::Duration;

use super::region::Control;

/// Sleeps while `word` still holds `expected`, at most `timeout`.
///
/// Returns early on a wake, a signal, or when the word already differs.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 for the call's duration, and
    // `ts` a valid timespec; FUTEX_WAIT (shared, not private: the word lives
    // in a mapping other processes wait on too) only reads them.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every thread sleeping on `word`.
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is valid and aligned; FUTEX_WAKE does not dereference it
    // beyond hashing its address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes the progress thread owning `control` if it asked for a doorbell.
///
/// Call after publishing what it waits for; the fence pairs with the one in
/// [`Control`]'s sleeper, so either it sees the update or this sees it asleep.
pub(crate) fn ring_if_sleeping(control: Control<'_>) {
    fence(Ordering::SeqCst);
    if control.sleeping.load(Ordering::Relaxed) != 0 {
        ring(control);
    }
}

/// Wakes the progress thread owning `control` unconditionally.
pub(crate) fn ring(control: Control<'_>) {
    control.doorbell.fetch_add(1, Ordering::SeqCst);
    futex_wake(control.doorbell);
}

/// Tells whether a peer process is still alive.
#[derive(Debug)]
pub(crate) enum Liveness {
    /// A pidfd: readable once the process has exited.
    Pidfd(OwnedFd),
    /// No pidfd (old kernel): probe with signal 0.
    Pid(libc::pid_t),
}

impl Liveness {
    /// Watches process `pid` (which must be in this PID namespace).
    pub fn watch(pid: u32) -> Liveness {
        let pid = pid as libc::pid_t;
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd >= 0 {
            // SAFETY: the kernel just returned this fd to us; we own it.
            Liveness::Pidfd(unsafe { OwnedFd::from_raw_fd(fd as i32) })
        } else {
            Liveness::Pid(pid)
        }
    }

    /// Whether the process has exited.
    pub fn dead(&self) -> bool {
        match self {
            Liveness::Pidfd(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, zero timeout.
                let n = unsafe { libc::poll(&mut p, 1, 0) };
                n > 0 && p.revents != 0
            }
            Liveness::Pid(pid) => {
                // SAFETY: signal 0 only checks that the process exists.
                let r = unsafe { libc::kill(*pid, 0) };
                r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[test]
    fn a_child_that_exits_is_seen_dead() {
        let mut child = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        let watch = Liveness::watch(child.id());
        assert!(!watch.dead());
        child.wait().unwrap();
        assert!(watch.dead());
        assert!(!Liveness::watch(std::process::id()).dead());
    }

    #[test]
    fn a_wake_ends_a_wait() {
        let word = std::sync::Arc::new(AtomicU32::new(0));
        let w = word.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            w.fetch_add(1, Ordering::SeqCst);
            futex_wake(&w);
        });
        // Without the wake the wait would run its full minute.
        let start = Instant::now();
        while word.load(Ordering::SeqCst) == 0 {
            futex_wait(&word, 0, Duration::from_secs(60));
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{:?}",
            start.elapsed()
        );
        t.join().unwrap();
        // A word that already differs returns at once.
        futex_wait(&word, 0, Duration::from_secs(3600));
    }
}
