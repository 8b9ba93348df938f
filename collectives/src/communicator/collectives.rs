//! The collectives' entry points: each checks its arguments, describes its call
//! ([`CallInfo`] and the buffers) and hands it to `prepare`, the one way every
//! collective is built and routed.

use chorus_kernels::{DType, Element, ReduceOp};

use super::{elements, Call, CallInfo, CallKind, Communicator, Inner};
use crate::executor::Buffers;
use crate::schedule::all_to_all;
use crate::{Error, Result};

impl Communicator {
    /// Reduces `buf` across all ranks in place; every rank ends with the result.
    ///
    /// Fails on a transport error or timeout, or if ranks pass different lengths.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.run_now(self.inner.all_reduce_call(
            None,
            bytemuck::cast_slice_mut(buf),
            T::DTYPE,
            op,
        )?)
    }

    /// Reduces `input` across all ranks into `output` (same length).
    ///
    /// Fails as [`all_reduce`](Self::all_reduce) does, or if the lengths differ.
    pub fn all_reduce_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let input = bytemuck::cast_slice(input);
        self.run_now(self.inner.all_reduce_call(
            Some(input),
            bytemuck::cast_slice_mut(output),
            T::DTYPE,
            op,
        )?)
    }

    /// All-reduce on raw bytes holding elements of `dtype`; in place when `input` is `None`.
    ///
    /// Fails as [`all_reduce`](Self::all_reduce) does, or if a length is not a
    /// whole number of elements.
    pub fn all_reduce_bytes(
        &self,
        input: Option<&[u8]>,
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.run_now(self.inner.all_reduce_call(input, output, dtype, op)?)
    }

    /// Copies `root`'s `buf` into every other rank's `buf`.
    ///
    /// Fails on a transport error or timeout, if `root` is out of range, or
    /// if ranks pass different lengths.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.run_now(self.inner.broadcast_call(
            None,
            bytemuck::cast_slice_mut(buf),
            T::DTYPE,
            root,
        )?)
    }

    /// Broadcast from `root`'s `input` into every rank's `output` (`input` is read on the root only).
    ///
    /// Fails as [`broadcast`](Self::broadcast) does, or if the lengths differ.
    pub fn broadcast_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        let input = bytemuck::cast_slice(input);
        self.run_now(self.inner.broadcast_call(
            Some(input),
            bytemuck::cast_slice_mut(output),
            T::DTYPE,
            root,
        )?)
    }

    /// Broadcast on raw bytes holding elements of `dtype`; in place when `input` is `None`.
    ///
    /// Fails as [`broadcast`](Self::broadcast) does.
    pub fn broadcast_bytes(
        &self,
        input: Option<&[u8]>,
        output: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        self.run_now(self.inner.broadcast_call(input, output, dtype, root)?)
    }

    /// Returns only after every rank has entered the barrier.
    ///
    /// Fails on a transport error or timeout.
    pub fn barrier(&self) -> Result<()> {
        self.run_now(self.inner.barrier_call()?)
    }

    /// Reduces every rank's `buf` into `root`'s `buf`.
    ///
    /// Other ranks' buffers serve as scratch: their contents afterwards are
    /// unspecified. Fails as [`all_reduce`](Self::all_reduce) does, or if `root` is not a rank.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        let output = bytemuck::cast_slice_mut(buf);
        self.run_now(self.inner.reduce_call(None, output, T::DTYPE, op, root)?)
    }

    /// Reduces every rank's `input` into `root`'s `output` (same length as `input`).
    ///
    /// Non-root outputs serve as scratch. Fails as [`reduce`](Self::reduce) does, or if the lengths differ.
    pub fn reduce_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let (input, output) = (
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        );
        self.run_now(
            self.inner
                .reduce_call(Some(input), output, T::DTYPE, op, root)?,
        )
    }

    /// Gathers every rank's `input` into every rank's `output`, block `q` from rank `q`.
    ///
    /// Fails unless `output.len() == world_size * input.len()`, or as other collectives do.
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let (input, output) = (
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        );
        self.run_now(self.inner.all_gather_call(input, output, T::DTYPE)?)
    }

    /// All-gather in place: this rank's block already sits at `buf[rank * n..(rank + 1) * n]`.
    ///
    /// Fails unless `buf.len()` is a multiple of the world size, or as other collectives do.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let buf = bytemuck::cast_slice_mut(buf);
        self.run_now(self.inner.all_gather_in_place_call(buf, T::DTYPE)?)
    }

    /// Reduces `input` (world_size blocks) across ranks; `output` receives block `rank` of the result.
    ///
    /// Fails unless `input.len() == world_size * output.len()`, or as other collectives do.
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.run_now(self.inner.reduce_scatter_call(
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
            T::DTYPE,
            op,
        )?)
    }

    /// Sends block `q` of `input` to rank `q` and receives rank `q`'s block into block `q` of `output`.
    ///
    /// Both buffers hold world_size equal blocks; fails otherwise, or as other collectives do.
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let counts = self.inner.equal_blocks(input.len(), output.len())?;
        self.all_to_all_v(input, &counts, output, &counts)
    }

    /// All-to-all with per-rank counts: `input` holds blocks of `send_counts[q]` elements for
    /// rank `q`, `output` receives blocks of `recv_counts[q]` elements from rank `q`.
    ///
    /// Fails if the counts do not match the buffers or the world size; a count that
    /// disagrees with the peer's is reported by the receiver as a length mismatch.
    pub fn all_to_all_v<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (input, output) = (
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        );
        let counts = (send_counts, recv_counts);
        self.run_now(
            self.inner
                .all_to_all_call(input, output, T::DTYPE, counts)?,
        )
    }

    /// Gathers every rank's `input` into `root`'s `output` (world_size blocks); other outputs are untouched.
    ///
    /// Fails unless the root's `output.len() == world_size * input.len()`, or as other collectives do.
    pub fn gather<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        let (input, output) = (
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        );
        self.run_now(
            self.inner
                .rooted_call(CallKind::Gather, input, output, T::DTYPE, root)?,
        )
    }

    /// Sends block `q` of `root`'s `input` (world_size blocks) to rank `q`'s `output`.
    ///
    /// Fails unless the root's `input.len() == world_size * output.len()`, or as other collectives do.
    pub fn scatter<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        let (input, output) = (
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        );
        self.run_now(
            self.inner
                .rooted_call(CallKind::Scatter, input, output, T::DTYPE, root)?,
        )
    }

    /// Runs a collective of `kind` on raw bytes of `dtype` now (the device paths' host
    /// step). `count` is the call's element count as [`CallInfo`] takes it.
    #[cfg(feature = "cuda")]
    pub(crate) fn run_bytes(
        &self,
        info: (CallKind, DType, ReduceOp, usize, usize),
        input: Option<&[u8]>,
        output: &mut [u8],
    ) -> Result<()> {
        let (kind, dtype, op, root, count) = info;
        self.inner.check_root(root)?;
        let info = CallInfo::new(kind, dtype, op, root, count)?;
        self.run_now(self.inner.prepare(info, Buffers::new(input, output))?)
    }
}

impl Inner {
    pub(super) fn all_reduce_call<'a>(
        &self,
        input: Option<&'a [u8]>,
        output: &'a mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Call<'a>> {
        let count = elements(output.len(), dtype)?;
        let info = CallInfo::new(CallKind::AllReduce, dtype, op, 0, count)?;
        self.prepare(info, Buffers::same_len(input, output)?)
    }

    pub(super) fn reduce_scatter_call<'a>(
        &self,
        input: &'a [u8],
        output: &'a mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Call<'a>> {
        let whole = elements(input.len(), dtype)?;
        let n = self.blocks(
            "reduce_scatter",
            "input",
            whole,
            elements(output.len(), dtype)?,
        )?;
        let info = CallInfo::new(CallKind::ReduceScatter, dtype, op, 0, n)?;
        self.prepare(info, Buffers::new(Some(input), output))
    }

    pub(super) fn broadcast_call<'a>(
        &self,
        input: Option<&'a [u8]>,
        output: &'a mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<Call<'a>> {
        let count = elements(output.len(), dtype)?;
        self.check_root(root)?;
        let info = CallInfo::new(CallKind::Broadcast, dtype, ReduceOp::Sum, root, count)?;
        self.prepare(info, Buffers::same_len(input, output)?)
    }

    pub(super) fn barrier_call(&self) -> Result<Call<'static>> {
        let info = CallInfo::new(CallKind::Barrier, DType::U8, ReduceOp::Sum, 0, 0)?;
        self.prepare(info, Buffers::new(None, &mut []))
    }

    pub(super) fn reduce_call<'a>(
        &self,
        input: Option<&'a [u8]>,
        output: &'a mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<Call<'a>> {
        let count = elements(input.map_or(output.len(), <[u8]>::len), dtype)?;
        let info = CallInfo::new(CallKind::Reduce, dtype, op, root, count)?;
        self.check_root(root)?;
        self.prepare(info, Buffers::same_len(input, output)?)
    }

    pub(super) fn all_gather_call<'a>(
        &self,
        input: &'a [u8],
        output: &'a mut [u8],
        dtype: DType,
    ) -> Result<Call<'a>> {
        let (whole, block) = (
            elements(output.len(), dtype)?,
            elements(input.len(), dtype)?,
        );
        let n = self.blocks("all_gather", "output", whole, block)?;
        let info = CallInfo::new(CallKind::AllGather, dtype, ReduceOp::Sum, 0, n)?;
        self.prepare(info, Buffers::new(Some(input), output))
    }

    pub(super) fn all_gather_in_place_call<'a>(
        &self,
        buf: &'a mut [u8],
        dtype: DType,
    ) -> Result<Call<'a>> {
        let whole = elements(buf.len(), dtype)?;
        let w = self.config.world_size;
        let n = self.blocks("all_gather_in_place", "buffer", whole, whole / w)?;
        let info = CallInfo::new(CallKind::AllGather, dtype, ReduceOp::Sum, 0, n)?;
        let block = n * dtype.size();
        let bufs = Buffers::inside(buf, self.config.rank * block, block);
        self.prepare(info, bufs)
    }

    /// Equal all-to-all blocks for buffers of `input` and `output` elements.
    pub(super) fn equal_blocks(&self, input: usize, output: usize) -> Result<Vec<usize>> {
        let w = self.config.world_size;
        if input != output || input % w != 0 {
            return Err(Error::InvalidArgument(format!(
                "all_to_all needs input and output of equal length divisible by the world size {w}; got {input} and {output}"
            )));
        }
        Ok(vec![input / w; w])
    }

    /// An all-to-all with `counts` (elements to send to, and receive from, each rank).
    pub(super) fn all_to_all_call<'a>(
        &self,
        input: &'a [u8],
        output: &'a mut [u8],
        dtype: DType,
        counts: (&[usize], &[usize]),
    ) -> Result<Call<'a>> {
        let (rank, w) = (self.config.rank, self.config.world_size);
        let (send_counts, recv_counts) = counts;
        all_to_all::validate(rank, w, send_counts, recv_counts).map_err(Error::InvalidArgument)?;
        let (sent, received): (usize, usize) = (send_counts.iter().sum(), recv_counts.iter().sum());
        let (input_len, output_len) = (
            elements(input.len(), dtype)?,
            elements(output.len(), dtype)?,
        );
        if sent != input_len || received != output_len {
            return Err(Error::InvalidArgument(format!(
                "all_to_all_v counts add up to {sent} to send and {received} to receive, but the buffers hold {input_len} and {output_len}"
            )));
        }
        // Counts may differ between ranks; each message's length is checked instead.
        let info = CallInfo::new(CallKind::AllToAll, dtype, ReduceOp::Sum, 0, 0)?;
        self.prepare_with(info, Buffers::new(Some(input), output), Some(counts))
    }

    /// A gather (`kind` [`CallKind::Gather`]: world size blocks into the root's `output`) or a
    /// scatter ([`CallKind::Scatter`]: the root's `input` of world size blocks out to every rank).
    pub(super) fn rooted_call<'a>(
        &self,
        kind: CallKind,
        input: &'a [u8],
        output: &'a mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<Call<'a>> {
        self.check_root(root)?;
        let (name, whole, block) = match kind {
            CallKind::Gather => ("output", output.len(), input.len()),
            _ => ("input", input.len(), output.len()),
        };
        let block = elements(block, dtype)?;
        if self.config.rank == root {
            self.blocks(kind.name(), name, elements(whole, dtype)?, block)?;
        }
        let info = CallInfo::new(kind, dtype, ReduceOp::Sum, root, block)?;
        self.prepare(info, Buffers::new(Some(input), output))
    }

    /// Checks that `whole` holds world_size blocks of `block` elements; returns `block`.
    pub(super) fn blocks(
        &self,
        call: &str,
        name: &str,
        whole: usize,
        block: usize,
    ) -> Result<usize> {
        let w = self.config.world_size;
        if whole != w * block {
            return Err(Error::InvalidArgument(format!(
                "{call}: the {name} has {whole} elements, expected world size {w} x {block} = {}",
                w * block
            )));
        }
        Ok(block)
    }

    pub(super) fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.config.world_size {
            return Err(Error::InvalidArgument(format!(
                "root {root} is not a rank (world size {})",
                self.config.world_size
            )));
        }
        Ok(())
    }
}
