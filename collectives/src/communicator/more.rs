//! The rooted and data-movement collectives: reduce, all-gather,
//! reduce-scatter, all-to-all, gather and scatter.

use std::sync::Arc;

use chorus_kernels::{DType, Element, ReduceOp};

use super::{Call, CallInfo, Communicator, Kind};
use crate::executor::Buffers;
use crate::schedule::{all_gather, all_to_all, gather, reduce, reduce_scatter, scatter, Schedule};
use crate::tuner::{Algorithm, Collective};
use crate::{Error, Result};

impl Communicator {
    /// Reduces every rank's `buf` into `root`'s `buf`.
    ///
    /// Other ranks' buffers serve as scratch: their contents afterwards are
    /// unspecified. Fails as [`all_reduce`](Self::all_reduce) does, or if `root` is not a rank.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        let output = bytemuck::cast_slice_mut(buf);
        let count = output.len() / T::DTYPE.size();
        let info = CallInfo::new(Kind::Reduce, T::DTYPE, op, root, count)?;
        let steps = self.reduce_steps(output.len(), T::DTYPE, root)?;
        self.run_typed(info, Buffers::new(None, output), steps)
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
        let count = input.len() / T::DTYPE.size();
        let info = CallInfo::new(Kind::Reduce, T::DTYPE, op, root, count)?;
        let steps = self.reduce_steps(output.len(), T::DTYPE, root)?;
        self.run_typed(info, Buffers::same_len(Some(input), output)?, steps)
    }

    fn reduce_steps(&self, bytes: usize, dtype: DType, root: usize) -> Result<Schedule> {
        self.inner.check_root(root)?;
        let (w, rank, chunk) = (
            self.world_size(),
            self.rank(),
            self.inner.chunk_elems(dtype),
        );
        let count = bytes / dtype.size();
        Ok(match self.inner.pick(Collective::Reduce, bytes) {
            Algorithm::Tree => reduce::tree(rank, w, root, count, chunk),
            _ => reduce::chain(rank, w, root, count, chunk),
        })
    }

    /// Gathers every rank's `input` into every rank's `output`, block `q` from rank `q`.
    ///
    /// Fails unless `output.len() == world_size * input.len()`, or as other collectives do.
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let n = self.blocks("all_gather", "output", output.len(), input.len())?;
        let steps = all_gather::ring(
            self.rank(),
            self.world_size(),
            n,
            self.inner.chunk_elems(T::DTYPE),
        );
        self.run_apart(
            CallInfo::new(Kind::AllGather, T::DTYPE, ReduceOp::Sum, 0, n)?,
            input,
            output,
            steps,
        )
    }

    /// All-gather in place: this rank's block already sits at `buf[rank * n..(rank + 1) * n]`.
    ///
    /// Fails unless `buf.len()` is a multiple of the world size, or as other collectives do.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let w = self.world_size();
        let n = self.blocks("all_gather_in_place", "buffer", buf.len(), buf.len() / w)?;
        let steps = all_gather::ring(self.rank(), w, n, self.inner.chunk_elems(T::DTYPE));
        let size = std::mem::size_of::<T>();
        let bufs = Buffers::inside(
            bytemuck::cast_slice_mut(buf),
            self.rank() * n * size,
            n * size,
        );
        self.run_typed(
            CallInfo::new(Kind::AllGather, T::DTYPE, ReduceOp::Sum, 0, n)?,
            bufs,
            steps,
        )
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
        let n = self.blocks("reduce_scatter", "input", input.len(), output.len())?;
        let info = CallInfo::new(Kind::ReduceScatter, T::DTYPE, op, 0, n)?;
        let steps = reduce_scatter::ring(
            self.rank(),
            self.world_size(),
            n,
            self.inner.chunk_elems(T::DTYPE),
        );
        self.run_apart(info, input, output, steps)
    }

    /// Sends block `q` of `input` to rank `q` and receives rank `q`'s block into block `q` of `output`.
    ///
    /// Both buffers hold world_size equal blocks; fails otherwise, or as other collectives do.
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let w = self.world_size();
        if input.len() != output.len() || input.len() % w != 0 {
            return Err(Error::InvalidArgument(format!(
                "all_to_all needs input and output of equal length divisible by the world size {w}; got {} and {}",
                input.len(),
                output.len()
            )));
        }
        let counts = vec![input.len() / w; w];
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
        let (rank, w) = (self.rank(), self.world_size());
        all_to_all::validate(rank, w, send_counts, recv_counts).map_err(Error::InvalidArgument)?;
        let (sent, received): (usize, usize) = (send_counts.iter().sum(), recv_counts.iter().sum());
        if sent != input.len() || received != output.len() {
            return Err(Error::InvalidArgument(format!(
                "all_to_all_v counts add up to {sent} to send and {received} to receive, but the buffers hold {} and {}",
                input.len(),
                output.len()
            )));
        }
        let steps = all_to_all::pairwise(rank, w, send_counts, recv_counts);
        // Counts may differ between ranks; each message's length is checked instead.
        let info = CallInfo::new(Kind::AllToAll, T::DTYPE, ReduceOp::Sum, 0, 0)?;
        self.run_apart(info, input, output, steps)
    }

    /// Gathers every rank's `input` into `root`'s `output` (world_size blocks); other outputs are untouched.
    ///
    /// Fails unless the root's `output.len() == world_size * input.len()`, or as other collectives do.
    pub fn gather<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        self.inner.check_root(root)?;
        if self.rank() == root {
            self.blocks("gather", "output", output.len(), input.len())?;
        }
        let steps = gather::direct(self.rank(), self.world_size(), root, input.len());
        let info = CallInfo::new(Kind::Gather, T::DTYPE, ReduceOp::Sum, root, input.len())?;
        self.run_apart(info, input, output, steps)
    }

    /// Sends block `q` of `root`'s `input` (world_size blocks) to rank `q`'s `output`.
    ///
    /// Fails unless the root's `input.len() == world_size * output.len()`, or as other collectives do.
    pub fn scatter<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        self.inner.check_root(root)?;
        if self.rank() == root {
            self.blocks("scatter", "input", input.len(), output.len())?;
        }
        let steps = scatter::direct(self.rank(), self.world_size(), root, output.len());
        let info = CallInfo::new(Kind::Scatter, T::DTYPE, ReduceOp::Sum, root, output.len())?;
        self.run_apart(info, input, output, steps)
    }

    /// Checks that `whole` holds world_size blocks of `block` elements; returns `block`.
    fn blocks(&self, call: &str, name: &str, whole: usize, block: usize) -> Result<usize> {
        let w = self.world_size();
        if whole != w * block {
            return Err(Error::InvalidArgument(format!(
                "{call}: the {name} has {whole} elements, expected world size {w} x {block} = {}",
                w * block
            )));
        }
        Ok(block)
    }

    /// Runs `steps` from `input` into a separate `output`.
    fn run_apart<T: Element>(
        &self,
        info: CallInfo,
        input: &[T],
        output: &mut [T],
        steps: Schedule,
    ) -> Result<()> {
        let bufs = Buffers::new(
            Some(bytemuck::cast_slice(input)),
            bytemuck::cast_slice_mut(output),
        );
        self.run_typed(info, bufs, steps)
    }

    fn run_typed(&self, info: CallInfo, bufs: Buffers<'_>, steps: Schedule) -> Result<()> {
        self.run_now(Call {
            info,
            bufs,
            steps: Arc::new(steps),
            shared: None,
        })
    }
}
