//! The asynchronous form of every call: it takes its buffers by value, returns a [`Work`]
//! at once, and runs in issue order with every other call (see [`work`](super::work)).
//!
//! Each describes its call through the same builder as its blocking form, in its turn;
//! arguments the builder refuses fail the handle and leave the communicator usable.

use chorus_kernels::{Element, ReduceOp};

use super::{Call, CallKind, Communicator, Inner, Work};

/// An owned buffer's elements as bytes.
fn bytes<T: Element>(buf: &impl AsRef<[T]>) -> &[u8] {
    bytemuck::cast_slice(buf.as_ref())
}

/// An owned buffer's elements as mutable bytes.
fn bytes_mut<T: Element>(buf: &mut impl AsMut<[T]>) -> &mut [u8] {
    bytemuck::cast_slice_mut(buf.as_mut())
}

impl Communicator {
    /// Queues a call on one buffer, in place.
    fn start_in_place<T, B, F>(&self, buf: B, build: F) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
        F: for<'a> FnOnce(&Inner, &'a mut [u8]) -> crate::Result<Call<'a>> + Send + 'static,
    {
        self.submit_call(buf, move |inner, buf| build(inner, bytes_mut(buf)))
    }

    /// Queues a call from `input` into a separate `output`.
    fn start_apart<T, I, O, F>(&self, input: I, output: O, build: F) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
        F: for<'a> FnOnce(&Inner, &'a [u8], &'a mut [u8]) -> crate::Result<Call<'a>>
            + Send
            + 'static,
    {
        self.submit_call((input, output), move |inner, (input, output)| {
            build(inner, bytes(input), bytes_mut(output))
        })
    }

    /// Starts an in-place all-reduce of `buf` and returns at once.
    ///
    /// The buffer comes back from [`Work::wait`]; errors surface there, as
    /// [`all_reduce`](Self::all_reduce)'s do.
    pub fn all_reduce_async<T, B>(&self, buf: B, op: ReduceOp) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.start_in_place(buf, move |inner, buf| {
            inner.all_reduce_call(None, buf, T::DTYPE, op)
        })
    }

    /// Starts an in-place broadcast of `root`'s `buf` and returns at once.
    ///
    /// The buffer comes back from [`Work::wait`]; errors surface there.
    pub fn broadcast_async<T, B>(&self, buf: B, root: usize) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.start_in_place(buf, move |inner, buf| {
            inner.broadcast_call(None, buf, T::DTYPE, root)
        })
    }

    /// Starts an in-place reduce of every rank's `buf` into `root`'s and returns at once.
    ///
    /// Other ranks' buffers serve as scratch, as in [`reduce`](Self::reduce).
    pub fn reduce_async<T, B>(&self, buf: B, op: ReduceOp, root: usize) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.start_in_place(buf, move |inner, buf| {
            inner.reduce_call(None, buf, T::DTYPE, op, root)
        })
    }

    /// Starts an all-gather of `input` into `output` (world size blocks) and returns at once.
    ///
    /// Both buffers come back from [`Work::wait`], `input` first.
    pub fn all_gather_async<T, I, O>(&self, input: I, output: O) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.start_apart(input, output, |inner, input, output| {
            inner.all_gather_call(input, output, T::DTYPE)
        })
    }

    /// Starts an in-place all-gather (this rank's block already in place, as in
    /// [`all_gather_in_place`](Self::all_gather_in_place)) and returns at once.
    pub fn all_gather_in_place_async<T, B>(&self, buf: B) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.start_in_place(buf, |inner, buf| {
            inner.all_gather_in_place_call(buf, T::DTYPE)
        })
    }

    /// Starts a reduce-scatter of `input` (world size blocks of `output`'s length) into
    /// `output` and returns at once.
    ///
    /// Both buffers come back from [`Work::wait`], `input` first; errors (lengths that do
    /// not fit included) surface there.
    pub fn reduce_scatter_async<T, I, O>(&self, input: I, output: O, op: ReduceOp) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.start_apart(input, output, move |inner, input, output| {
            inner.reduce_scatter_call(input, output, T::DTYPE, op)
        })
    }

    /// Starts an all-to-all of equal blocks (as [`all_to_all`](Self::all_to_all)) and
    /// returns at once.
    pub fn all_to_all_async<T, I, O>(&self, input: I, output: O) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.start_apart(input, output, |inner, input, output| {
            let (sent, received) = (
                input.len() / T::DTYPE.size(),
                output.len() / T::DTYPE.size(),
            );
            let counts = inner.equal_blocks(sent, received)?;
            inner.all_to_all_call(input, output, T::DTYPE, (&counts, &counts))
        })
    }

    /// Starts an all-to-all with per-rank counts (as [`all_to_all_v`](Self::all_to_all_v))
    /// and returns at once.
    pub fn all_to_all_v_async<T, I, O>(
        &self,
        input: I,
        send_counts: Vec<usize>,
        output: O,
        recv_counts: Vec<usize>,
    ) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.start_apart(input, output, move |inner, input, output| {
            inner.all_to_all_call(input, output, T::DTYPE, (&send_counts, &recv_counts))
        })
    }

    /// Starts a gather of every rank's `input` into `root`'s `output` and returns at once.
    pub fn gather_async<T, I, O>(&self, input: I, output: O, root: usize) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.start_apart(input, output, move |inner, input, output| {
            inner.rooted_call(CallKind::Gather, input, output, T::DTYPE, root)
        })
    }

    /// Starts a scatter of `root`'s `input` into every rank's `output` and returns at once.
    pub fn scatter_async<T, I, O>(&self, input: I, output: O, root: usize) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.start_apart(input, output, move |inner, input, output| {
            inner.rooted_call(CallKind::Scatter, input, output, T::DTYPE, root)
        })
    }

    /// Starts a barrier and returns at once; the handle completes once every rank has
    /// entered it.
    pub fn barrier_async(&self) -> Work<()> {
        self.submit_call((), |inner, ()| inner.barrier_call())
    }
}
