//! The collective operations: typed entry points over one byte-level form each.

use chorus_kernels::{DType, Element, ReduceOp};

use super::recent::Key;
use super::{elements, Call, CallInfo, Communicator, Inner, Kind};
use crate::executor::Buffers;
use crate::schedule::{barrier, broadcast, ring, tree};
use crate::schedule::{hierarchical, recursive};
use crate::tuner::{Algorithm, Collective};
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
        let info = CallInfo::new(Kind::Barrier, DType::U8, ReduceOp::Sum, 0, 0)?;
        let steps = self.inner.recent.get_or_build(Key::of(&info), || {
            barrier::dissemination(self.rank(), self.world_size())
        });
        let bufs = Buffers::new(None, &mut []);
        self.run_now(Call {
            info,
            shared: self.inner.shared_call(&info, &bufs),
            bufs,
            steps,
        })
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
        let info = CallInfo::new(Kind::AllReduce, dtype, op, 0, count)?;
        let (w, rank, chunk) = (
            self.config.world_size,
            self.config.rank,
            self.chunk_elems(dtype),
        );
        let local = self.config.local_world_size;
        let hosts_with_peers = local > 1 && local < w && w % local == 0;
        let steps = self.recent.get_or_build(Key::of(&info), || {
            if hosts_with_peers && self.config.algo.get(Collective::AllReduce).is_none() {
                // Several hosts with several ranks each: keep most traffic inside hosts.
                tracing::debug!(count, %dtype, %op, local, "all_reduce: hierarchical");
                hierarchical::all_reduce(rank, w, local, count, chunk)
            } else {
                match self.pick(Collective::AllReduce, output.len()) {
                    Algorithm::Tree => tree::all_reduce(rank, w, count, chunk),
                    Algorithm::RecursiveDoubling => recursive::doubling(rank, w, count, chunk),
                    Algorithm::HalvingDoubling => {
                        recursive::halving_doubling(rank, w, count, chunk)
                    }
                    Algorithm::Ring | Algorithm::Direct => ring::all_reduce(rank, w, count, chunk),
                }
            }
        });
        let bufs = Buffers::same_len(input, output)?;
        Ok(Call {
            info,
            shared: self.shared_call(&info, &bufs),
            bufs,
            steps,
        })
    }

    pub(super) fn broadcast_call<'a>(
        &self,
        input: Option<&'a [u8]>,
        output: &'a mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<Call<'a>> {
        let count = elements(output.len(), dtype)?;
        let (w, rank, chunk) = (
            self.config.world_size,
            self.config.rank,
            self.chunk_elems(dtype),
        );
        self.check_root(root)?;
        let info = CallInfo::new(Kind::Broadcast, dtype, ReduceOp::Sum, root, count)?;
        let steps = self.recent.get_or_build(Key::of(&info), || {
            match self.pick(Collective::Broadcast, output.len()) {
                Algorithm::Tree => broadcast::tree(rank, w, root, count, chunk),
                _ => broadcast::chain(rank, w, root, count, chunk),
            }
        });
        let bufs = Buffers::same_len(input, output)?;
        Ok(Call {
            info,
            shared: self.shared_call(&info, &bufs),
            bufs,
            steps,
        })
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

    /// The tuner's algorithm for `c` on `bytes`; logs the reasoning when the pick changes.
    pub(super) fn pick(&self, c: Collective, bytes: usize) -> Algorithm {
        let w = self.config.world_size;
        let choice = self.tuner.decide(c, bytes, w);
        let mut last = super::lock(&self.picks);
        if last.insert(c, choice.algorithm) != Some(choice.algorithm) {
            tracing::info!("{}", self.tuner.explain(c, bytes, w));
        } else {
            tracing::debug!(%c, bytes, algorithm = %choice.algorithm, "tuner");
        }
        choice.algorithm
    }
}
