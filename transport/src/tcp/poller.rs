//! The one owner of the TCP engine's readiness: which sockets a sleeping thread watches, the
//! two doorbells that wake sleepers, and how the sockets found ready are served.
//!
//! Two kinds of thread sleep here, in `poll(2)` on sockets chosen from the queues (so the set
//! is never stale and nothing is registered):
//!
//! * a **waiter** (a thread in [`Request::wait`](crate::Request::wait)) watches every socket
//!   with a receive posted or a send queued, and the *doorbell*, rung when some request
//!   settles while waiters sleep, and reads and writes itself when woken: a message costs no
//!   hop through another thread;
//! * the **background** thread watches only sockets with sends queued (bytes leave while the
//!   caller computes) and the *kick*, rung when a post leaves bytes queued on a socket it did
//!   not watch, when a socket stopped on its budget, and to stop it. It never reads except to
//!   finish what a waiter left at its budget, so received bytes wait in the kernel for their
//!   waiter.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// How long a sleeper naps when `poll(2)` fails.
const NAP: Duration = Duration::from_millis(2);

/// Who sleeps: a waiter on some request, or the background thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sleeper {
    Waiter,
    Background,
}

/// The doorbells; the sockets are the engine's.
#[derive(Debug)]
pub(crate) struct Poller {
    doorbell: OwnedFd,
    kick: OwnedFd,
}

/// The sockets one sleep watches: `fds[0]` is the sleeper's doorbell, `fds[k + 1]` socket
/// `conns[k]`.
pub(crate) struct Watch {
    fds: Vec<libc::pollfd>,
    conns: Vec<usize>,
}

impl Poller {
    /// Two fresh doorbells.
    pub(crate) fn new() -> io::Result<Poller> {
        Ok(Poller {
            doorbell: eventfd()?,
            kick: eventfd()?,
        })
    }

    /// Wakes the waiters asleep here.
    pub(crate) fn ring(&self) {
        signal(&self.doorbell);
    }

    /// Wakes the background thread.
    pub(crate) fn kick(&self) {
        signal(&self.kick);
    }

    /// Clears the waiters' doorbell (the last waiter up does, so none misses a ring).
    pub(crate) fn clear_doorbell(&self) {
        drain(&self.doorbell);
    }

    /// What `who` watches of the sockets `queued` (each socket's index, descriptor, and
    /// whether it has a receive posted and a send queued); `None` if a waiter has nothing to
    /// watch (nothing queued, so nothing pending that bytes could finish).
    pub(crate) fn watch(
        &self,
        queued: impl Iterator<Item = (usize, libc::c_int, bool, bool)>,
        who: Sleeper,
    ) -> Option<Watch> {
        let bell = match who {
            Sleeper::Waiter => &self.doorbell,
            Sleeper::Background => &self.kick,
        };
        let mut watch = Watch {
            fds: vec![pollfd(bell.as_raw_fd(), libc::POLLIN)],
            conns: Vec::new(),
        };
        for (idx, fd, reads, writes) in queued {
            let mut events = 0;
            if reads && who == Sleeper::Waiter {
                events |= libc::POLLIN;
            }
            if writes {
                events |= libc::POLLOUT;
            }
            if events != 0 {
                watch.fds.push(pollfd(fd, events));
                watch.conns.push(idx);
            }
        }
        if who == Sleeper::Waiter && watch.conns.is_empty() {
            return None;
        }
        Some(watch)
    }

    /// Sleeps in `poll(2)` until something `watch` names is ready or `until` passes (`None`:
    /// no limit). If the sockets cannot be watched (out of memory), naps instead and marks
    /// them all ready.
    pub(crate) fn sleep(&self, watch: &mut Watch, until: Option<Instant>) {
        // Whole milliseconds, rounded up so that a wait does not spin through its last one.
        let timeout = until.map_or(-1, |at| {
            let left = at.saturating_duration_since(Instant::now());
            left.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int
        });
        // SAFETY: `fds` is an array of `fds.len()` initialised pollfd records. The sockets stay
        // open while the engine lives (they are only shut down, never closed, before the drop).
        let ready = unsafe {
            libc::poll(
                watch.fds.as_mut_ptr(),
                watch.fds.len() as libc::nfds_t,
                timeout,
            )
        };
        if ready < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            std::thread::sleep(NAP);
            for p in &mut watch.fds[1..] {
                p.revents = p.events;
            }
        }
    }

    /// The sockets `watch` found ready, each with whether to read and to write it.
    pub(crate) fn ready<'a>(
        &self,
        watch: &'a Watch,
    ) -> impl Iterator<Item = (usize, bool, bool)> + 'a {
        watch.fds[1..]
            .iter()
            .zip(&watch.conns)
            .filter_map(|(p, &idx)| {
                let hangup = p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0;
                let read = hangup || p.revents & libc::POLLIN != 0;
                let write = hangup || p.revents & libc::POLLOUT != 0;
                (read || write).then_some((idx, read, write))
            })
    }

    /// Whether the sleeper's doorbell rang while it slept on `watch`.
    pub(crate) fn rang(&self, watch: &Watch) -> bool {
        watch.fds[0].revents != 0
    }

    /// Clears the background thread's kick after it rang.
    pub(crate) fn clear_kick(&self) {
        drain(&self.kick);
    }
}

fn pollfd(fd: libc::c_int, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes no pointers.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a non-negative result is a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn signal(fd: &OwnedFd) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a live u64 to our eventfd. It can only fail with the counter
    // full, and then it is readable anyway.
    unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

fn drain(fd: &OwnedFd) {
    let mut count = 0u64;
    // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd.
    unsafe { libc::read(fd.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
}
