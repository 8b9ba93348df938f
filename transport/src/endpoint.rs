//! What the TCP and shared-memory transports share around their engines: the background
//! thread beside the engine, posting through the engine, and closing it on drop.
//!
//! An engine is a [`Progress`] (waiters drive it) that also posts, probes and aborts; an
//! [`Endpoint`] turns one into a [`Transport`]. A future engine (RDMA verbs, say) plugs in
//! the same way: its `post` registers the buffer or takes it from a registered region and
//! queues a work request, its background thread polls the completion queue.

use std::sync::Arc;
use std::thread::JoinHandle;

use crate::request::Progress;
use crate::{Exchange, Payload, Request, Transport, TransportError};

/// A progress engine behind an [`Endpoint`].
pub(crate) trait Engine: Progress + 'static {
    /// Queues `payload` with `peer` and moves what can move now.
    ///
    /// # Safety
    ///
    /// As for [`Transport::post`]: the payload's memory stays valid (and, for a receive,
    /// unaliased) until the request completes or the engine is aborted.
    unsafe fn post(
        &self,
        peer: usize,
        tag: u64,
        payload: Payload<'_>,
    ) -> Result<Request, TransportError>;

    /// Takes a [`Transport::sendrecv`] whose bytes the engine can move at once, returning
    /// its requests still pending (which need no progress hook yet); `None` leaves the
    /// exchange to be posted as usual, and posts nothing.
    ///
    /// # Safety
    ///
    /// As for [`post`](Engine::post), for both buffers.
    unsafe fn sendrecv(
        &self,
        _to: usize,
        _from: usize,
        _tag: u64,
        _data: &[u8],
        _buf: &mut [u8],
    ) -> Result<Option<Exchange>, TransportError> {
        Ok(None)
    }

    /// As [`Transport::probe`].
    fn probe(&self, peer: usize) -> Result<Option<(u64, usize)>, TransportError>;

    /// As [`Transport::abort`].
    fn abort(&self, reason: &str);

    /// As [`Transport::unanswered`].
    fn unanswered(&self, _peer: usize) -> Option<std::time::Duration> {
        None
    }

    /// The background thread's loop; returns soon after [`stop`](Engine::stop).
    fn run(&self);

    /// Asks the background thread to return.
    fn stop(&self);

    /// Once the background thread has returned: fails whatever is still pending.
    fn close(&self);
}

/// A [`Transport`] made of an engine and its background thread.
#[derive(Debug)]
pub(crate) struct Endpoint<E: Engine> {
    rank: usize,
    world_size: usize,
    engine: Arc<E>,
    thread: Option<JoinHandle<()>>,
}

impl<E: Engine> Endpoint<E> {
    /// Starts `engine`'s background thread, named for `kind` and `rank`.
    pub fn start(
        rank: usize,
        world_size: usize,
        kind: &str,
        engine: Arc<E>,
    ) -> Result<Endpoint<E>, TransportError> {
        let runner = engine.clone();
        let thread = std::thread::Builder::new()
            .name(format!("chorus-{kind}-{rank}"))
            .spawn(move || runner.run())
            .map_err(|e| TransportError::resource("cannot start the progress thread", e))?;
        Ok(Endpoint {
            rank,
            world_size,
            engine,
            thread: Some(thread),
        })
    }
}

impl<E: Engine> Transport for Endpoint<E> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    unsafe fn post(
        &self,
        peer: usize,
        tag: u64,
        payload: Payload<'_>,
    ) -> Result<Request, TransportError> {
        // SAFETY: the caller's guarantee, passed on.
        let req = unsafe { self.engine.post(peer, tag, payload) };
        req.map(|r| r.with_progress(self.engine.clone()))
    }

    fn probe(&self, peer: usize) -> Result<Option<(u64, usize)>, TransportError> {
        self.engine.probe(peer)
    }

    unsafe fn sendrecv(
        &self,
        to: usize,
        from: usize,
        tag: u64,
        data: &[u8],
        buf: &mut [u8],
    ) -> Result<Exchange, TransportError> {
        // SAFETY: the caller's guarantee, passed on.
        let Some(Exchange { send, recv }) =
            (unsafe { self.engine.sendrecv(to, from, tag, data, buf)? })
        else {
            // SAFETY: as above.
            return unsafe { Exchange::posted(self, to, from, tag, data, buf) };
        };
        let progress = |r: Request| r.with_progress(self.engine.clone());
        Ok(Exchange {
            send: send.map(progress),
            recv: recv.map(progress),
        })
    }

    fn abort(&self, reason: &str) {
        self.engine.abort(reason);
    }

    fn unanswered(&self, peer: usize) -> Option<std::time::Duration> {
        self.engine.unanswered(peer)
    }
}

impl<E: Engine> Drop for Endpoint<E> {
    fn drop(&mut self) {
        self.engine.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.engine.close();
    }
}

/// Implements [`Transport`] for a type by handing every call to its [`Endpoint`] field.
macro_rules! through_endpoint {
    ($ty:ty, $field:ident) => {
        impl $crate::Transport for $ty {
            fn rank(&self) -> usize {
                self.$field.rank()
            }

            fn world_size(&self) -> usize {
                self.$field.world_size()
            }

            unsafe fn post(
                &self,
                peer: usize,
                tag: u64,
                payload: $crate::Payload<'_>,
            ) -> Result<$crate::Request, $crate::TransportError> {
                // SAFETY: the caller's guarantee is passed on unchanged.
                unsafe { self.$field.post(peer, tag, payload) }
            }

            fn probe(&self, peer: usize) -> Result<Option<(u64, usize)>, $crate::TransportError> {
                self.$field.probe(peer)
            }

            unsafe fn sendrecv(
                &self,
                to: usize,
                from: usize,
                tag: u64,
                data: &[u8],
                buf: &mut [u8],
            ) -> Result<$crate::Exchange, $crate::TransportError> {
                // SAFETY: the caller's guarantee is passed on unchanged.
                unsafe { self.$field.sendrecv(to, from, tag, data, buf) }
            }

            fn abort(&self, reason: &str) {
                self.$field.abort(reason)
            }

            fn unanswered(&self, peer: usize) -> Option<std::time::Duration> {
                self.$field.unanswered(peer)
            }
        }
    };
}
pub(crate) use through_endpoint;
