//! What each perf binary measures: buffer shapes, nccl-tests' bus-bandwidth
//! factors, how one operation runs (out of place and in place), and what a
//! correct result holds.

use chorus::{check, Communicator, DType, Element, ReduceOp};

use super::buffer::Buffer;

/// How a size from the sweep becomes buffers, as nccl-tests counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `count` elements in and out (all-reduce, broadcast, reduce, send/recv).
    Whole,
    /// One block in, world-size blocks out (all-gather).
    Gather,
    /// World-size blocks in, one block out (reduce-scatter).
    Scatter,
    /// World-size blocks in and out (all-to-all).
    Exchange,
    /// No data at all (barrier).
    Empty,
}

/// The element counts of one measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Elements per block: the `count` column.
    pub block: usize,
    /// Elements each rank sends.
    pub send: usize,
    /// Elements each rank receives.
    pub recv: usize,
}

impl Layout {
    /// The layout for `count` elements of `elem_size` bytes over `world` ranks; blocks
    /// are rounded down to whole 16-byte units as in nccl-tests.
    pub fn new(shape: Shape, count: usize, elem_size: usize, world: usize) -> Layout {
        let block = (count / world) & !((16 / elem_size).max(1) - 1);
        let (send, recv) = match shape {
            Shape::Whole => return Layout::same(count),
            Shape::Empty => return Layout::same(0),
            Shape::Gather => (block, block * world),
            Shape::Scatter => (block * world, block),
            Shape::Exchange => (block * world, block * world),
        };
        Layout { block, send, recv }
    }

    fn same(count: usize) -> Layout {
        Layout {
            block: count,
            send: count,
            recv: count,
        }
    }

    /// The `size` column: the larger of the two buffers, in elements.
    pub fn size(&self) -> usize {
        self.send.max(self.recv)
    }
}

/// What a correct result holds.
#[derive(Debug, Clone, Copy)]
pub enum Data {
    /// The reduction of every rank's input with the `-o` operator; on the root only if `root_only`.
    Reduced {
        /// Only the root's output is defined (reduce).
        root_only: bool,
    },
    /// Bytes moved: output block `q` of `rank` is input block `.1` of rank `.0`,
    /// as given by `source(rank, world, root, q)`.
    Moved(fn(usize, usize, usize, usize) -> (usize, usize)),
    /// Nothing to check (barrier).
    Nothing,
}

/// The parameters of one call.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// Element type.
    pub dtype: DType,
    /// Reduction operator (reducing collectives only).
    pub op: ReduceOp,
    /// Root rank (rooted collectives only).
    pub root: usize,
}

/// The buffers of one call.
pub enum Bufs<'a> {
    /// Out of place: read `input`, write `output`.
    Apart {
        /// The send buffer.
        input: &'a [u8],
        /// The receive buffer.
        output: &'a mut [u8],
    },
    /// In place: `buf` holds the input (at nccl-tests' in-place offset) and receives the result.
    InPlace {
        /// The one buffer.
        buf: &'a mut [u8],
        /// Room for collectives that Chorus runs out of place only.
        scratch: &'a mut Buffer,
    },
}

/// Runs one operation.
pub type RunFn = fn(&Communicator, Bufs<'_>, Params) -> chorus::Result<()>;

/// What a perf binary measures.
pub struct Collective {
    /// The operation's name, e.g. "all_reduce".
    pub name: &'static str,
    /// busbw = algbw * bus_factor(world_size), nccl-tests' formula.
    pub bus_factor: fn(usize) -> f64,
    /// How sizes become buffers.
    pub shape: Shape,
    /// Whether `-r` applies and the root column shows it.
    pub rooted: bool,
    /// What a correct result holds (and whether `-o` applies).
    pub data: Data,
    /// Runs the operation.
    pub run: RunFn,
}

impl Collective {
    /// Whether the operation reduces (the redop column shows `-o`).
    pub fn reduces(&self) -> bool {
        matches!(self.data, Data::Reduced { .. })
    }

    /// Where this rank's input starts inside the in-place buffer, in elements.
    pub fn in_place_input(&self, layout: &Layout, rank: usize) -> usize {
        match self.shape {
            Shape::Gather => rank * layout.block,
            _ => 0,
        }
    }

    /// Where this rank's result lies inside the in-place buffer, in elements.
    pub fn in_place_output(&self, layout: &Layout, rank: usize) -> std::ops::Range<usize> {
        match self.shape {
            Shape::Scatter => rank * layout.block..(rank + 1) * layout.block,
            _ => 0..layout.recv,
        }
    }

    fn input_blocks(&self, world: usize) -> usize {
        match self.shape {
            Shape::Scatter | Shape::Exchange => world,
            _ => 1,
        }
    }

    /// Fills `input` (the send buffer, `layout.send` elements) with rank `rank`'s test data.
    pub fn fill_input(
        &self,
        p: Params,
        layout: &Layout,
        rank: usize,
        world: usize,
        input: &mut [u8],
    ) {
        let blocks = self.input_blocks(world);
        let block_bytes = layout.send / blocks * p.dtype.size();
        if block_bytes == 0 {
            return;
        }
        for (b, block) in input.chunks_exact_mut(block_bytes).enumerate() {
            match self.data {
                // Every block restarts the pattern's index, so a reduce-scatter block
                // checks like an all-reduce result.
                Data::Reduced { .. } => check::fill(p.dtype, rank, p.op, block),
                Data::Moved(_) => fill_moved(rank, b, block),
                Data::Nothing => {}
            }
        }
    }

    /// Counts the wrong elements of this rank's result `output` (`layout.recv` elements).
    pub fn count_wrong(
        &self,
        p: Params,
        layout: &Layout,
        rank: usize,
        world: usize,
        output: &[u8],
    ) -> usize {
        match self.data {
            Data::Reduced { root_only } if !root_only || rank == p.root => {
                check::count_wrong(p.dtype, world, p.op, output)
            }
            Data::Moved(source) => {
                let block_bytes = layout.block * p.dtype.size();
                if block_bytes == 0 {
                    return 0;
                }
                let mut want = vec![0u8; block_bytes];
                output
                    .chunks_exact(block_bytes)
                    .enumerate()
                    .map(|(q, got)| {
                        let (src_rank, src_block) = source(rank, world, p.root, q);
                        fill_moved(src_rank, src_block, &mut want);
                        got.chunks_exact(p.dtype.size())
                            .zip(want.chunks_exact(p.dtype.size()))
                            .filter(|(g, w)| g != w)
                            .count()
                    })
                    .sum()
            }
            _ => 0,
        }
    }
}

/// Fills block `block` of rank `rank`'s input to a data-moving collective with bytes
/// that differ between ranks, blocks and positions.
fn fill_moved(rank: usize, block: usize, buf: &mut [u8]) {
    let seed = (rank as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (block as u64) << 32;
    for (j, b) in buf.iter_mut().enumerate() {
        let x = seed
            .wrapping_add(j as u64)
            .wrapping_mul(0xd6e8_feb8_6659_fd93);
        *b = (x >> 56) as u8;
    }
}

fn cast<T: Element>(bytes: &[u8]) -> &[T] {
    bytemuck::cast_slice(bytes)
}

fn cast_mut<T: Element>(bytes: &mut [u8]) -> &mut [T] {
    bytemuck::cast_slice_mut(bytes)
}

/// Runs an out-of-place-only operation in place: into scratch, then copied back over `range`.
fn through_scratch(
    buf: &mut [u8],
    scratch: &mut Buffer,
    range: std::ops::Range<usize>,
    run: impl FnOnce(&[u8], &mut [u8]) -> chorus::Result<()>,
) -> chorus::Result<()> {
    let tmp = scratch.bytes_mut(range.len());
    run(buf, tmp)?;
    buf[range].copy_from_slice(tmp);
    Ok(())
}

fn reduce<T: Element>(comm: &Communicator, bufs: Bufs<'_>, p: Params) -> chorus::Result<()> {
    match bufs {
        Bufs::Apart { input, output } => {
            comm.reduce_into(cast::<T>(input), cast_mut::<T>(output), p.op, p.root)
        }
        Bufs::InPlace { buf, .. } => comm.reduce(cast_mut::<T>(buf), p.op, p.root),
    }
}

fn reduce_scatter<T: Element>(
    comm: &Communicator,
    bufs: Bufs<'_>,
    p: Params,
) -> chorus::Result<()> {
    match bufs {
        Bufs::Apart { input, output } => {
            comm.reduce_scatter(cast::<T>(input), cast_mut::<T>(output), p.op)
        }
        Bufs::InPlace { buf, scratch } => {
            let n = buf.len() / comm.world_size();
            let range = comm.rank() * n..(comm.rank() + 1) * n;
            through_scratch(buf, scratch, range, |input, output| {
                comm.reduce_scatter(cast::<T>(input), cast_mut::<T>(output), p.op)
            })
        }
    }
}

/// All-reduce: busbw = algbw * 2(W-1)/W.
pub const ALL_REDUCE: Collective = Collective {
    name: "all_reduce",
    bus_factor: |w| 2.0 * (w as f64 - 1.0) / w as f64,
    shape: Shape::Whole,
    rooted: false,
    data: Data::Reduced { root_only: false },
    run: |comm, bufs, p| match bufs {
        Bufs::Apart { input, output } => comm.all_reduce_bytes(Some(input), output, p.dtype, p.op),
        Bufs::InPlace { buf, .. } => comm.all_reduce_bytes(None, buf, p.dtype, p.op),
    },
};

/// Broadcast from `-r`: busbw = algbw.
pub const BROADCAST: Collective = Collective {
    name: "broadcast",
    bus_factor: |_| 1.0,
    shape: Shape::Whole,
    rooted: true,
    data: Data::Moved(|_, _, root, _| (root, 0)),
    run: |comm, bufs, p| match bufs {
        Bufs::Apart { input, output } => comm.broadcast_bytes(Some(input), output, p.dtype, p.root),
        Bufs::InPlace { buf, .. } => comm.broadcast_bytes(None, buf, p.dtype, p.root),
    },
};

/// Reduce to `-r`: busbw = algbw.
pub const REDUCE: Collective = Collective {
    name: "reduce",
    bus_factor: |_| 1.0,
    shape: Shape::Whole,
    rooted: true,
    data: Data::Reduced { root_only: true },
    run: |comm, bufs, p| chorus::with_dtype!(p.dtype, reduce, comm, bufs, p),
};

/// All-gather: busbw = algbw * (W-1)/W, algbw over the gathered size.
pub const ALL_GATHER: Collective = Collective {
    name: "all_gather",
    bus_factor: |w| (w as f64 - 1.0) / w as f64,
    shape: Shape::Gather,
    rooted: false,
    data: Data::Moved(|_, _, _, q| (q, 0)),
    run: |comm, bufs, _| match bufs {
        Bufs::Apart { input, output } => comm.all_gather(input, output),
        Bufs::InPlace { buf, .. } => comm.all_gather_in_place(buf),
    },
};

/// Reduce-scatter: busbw = algbw * (W-1)/W, algbw over the input size.
///
/// Chorus has no in-place reduce-scatter: the in-place column runs it into
/// scratch and copies this rank's block back, and its time includes the copy.
pub const REDUCE_SCATTER: Collective = Collective {
    name: "reduce_scatter",
    bus_factor: |w| (w as f64 - 1.0) / w as f64,
    shape: Shape::Scatter,
    rooted: false,
    data: Data::Reduced { root_only: false },
    run: |comm, bufs, p| chorus::with_dtype!(p.dtype, reduce_scatter, comm, bufs, p),
};

/// All-to-all: busbw = algbw * (W-1)/W.
///
/// In place it runs into scratch and copies back (Chorus has no in-place all-to-all).
pub const ALL_TO_ALL: Collective = Collective {
    name: "alltoall",
    bus_factor: |w| (w as f64 - 1.0) / w as f64,
    shape: Shape::Exchange,
    rooted: false,
    data: Data::Moved(|rank, _, _, q| (q, rank)),
    run: |comm, bufs, _| match bufs {
        Bufs::Apart { input, output } => comm.all_to_all(input, output),
        Bufs::InPlace { buf, scratch } => {
            let all = 0..buf.len();
            through_scratch(buf, scratch, all, |i, o| comm.all_to_all(i, o))
        }
    },
};

/// Send to rank+1 while receiving from rank-1: busbw = algbw.
///
/// In place it receives into scratch and copies back.
pub const SEND_RECV: Collective = Collective {
    name: "sendrecv",
    bus_factor: |_| 1.0,
    shape: Shape::Whole,
    rooted: false,
    data: Data::Moved(|rank, world, _, _| ((rank + world - 1) % world, 0)),
    run: |comm, bufs, _| {
        let (rank, world) = (comm.rank(), comm.world_size());
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        let exchange = |input: &[u8], output: &mut [u8]| {
            comm.group(|g| {
                g.send(input, next, 0);
                g.recv(output, prev, 0);
            })
        };
        match bufs {
            Bufs::Apart { input, output } => exchange(input, output),
            Bufs::InPlace { buf, scratch } => {
                let all = 0..buf.len();
                through_scratch(buf, scratch, all, exchange)
            }
        }
    },
};

/// Barrier latency: no data, one row of size 0.
pub const BARRIER: Collective = Collective {
    name: "barrier",
    bus_factor: |_| 0.0,
    shape: Shape::Empty,
    rooted: false,
    data: Data::Nothing,
    run: |comm, _, _| comm.barrier(),
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_follow_nccl_tests_counts() {
        let l = Layout::new(Shape::Gather, 1000, 4, 3);
        assert_eq!((l.block, l.send, l.recv), (332, 332, 996));
        let l = Layout::new(Shape::Scatter, 1000, 4, 3);
        assert_eq!((l.block, l.send, l.recv, l.size()), (332, 996, 332, 996));
        let l = Layout::new(Shape::Exchange, 2, 4, 4);
        assert_eq!((l.block, l.size()), (0, 0));
        let l = Layout::new(Shape::Whole, 7, 8, 4);
        assert_eq!((l.block, l.send, l.recv), (7, 7, 7));
    }

    #[test]
    fn moved_data_checks_catch_misrouted_blocks() {
        let p = Params {
            dtype: DType::F32,
            op: ReduceOp::Sum,
            root: 0,
        };
        let world = 3;
        let layout = Layout::new(Shape::Gather, 48, 4, world);
        let mut gathered = vec![0u8; layout.recv * 4];
        for (q, block) in gathered.chunks_exact_mut(layout.block * 4).enumerate() {
            ALL_GATHER.fill_input(p, &layout, q, world, block);
        }
        assert_eq!(ALL_GATHER.count_wrong(p, &layout, 1, world, &gathered), 0);
        let (a, b) = gathered.split_at_mut(layout.block * 4);
        a.swap_with_slice(&mut b[..layout.block * 4]);
        assert_eq!(
            ALL_GATHER.count_wrong(p, &layout, 1, world, &gathered),
            2 * layout.block
        );
    }

    #[test]
    fn reduce_checks_only_the_root() {
        let p = Params {
            dtype: DType::I32,
            op: ReduceOp::Sum,
            root: 1,
        };
        let layout = Layout::new(Shape::Whole, 16, 4, 2);
        let garbage = vec![0xffu8; 64];
        assert_eq!(REDUCE.count_wrong(p, &layout, 0, 2, &garbage), 0);
        assert_eq!(REDUCE.count_wrong(p, &layout, 1, 2, &garbage), 16);
    }
}
