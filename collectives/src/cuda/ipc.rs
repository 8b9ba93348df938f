//! The IPC path: ranks of one host read and reduce each other's device memory directly.
//!
//! Every rank allocates a scratch buffer with `cuMemAlloc`, exports it with
//! `cuIpcGetMemHandle`, and maps every peer's with `cuIpcOpenMemHandle`. A call runs in
//! rounds of at most half a scratch buffer, the rounds alternating between the halves.
//! In a round each rank copies its input into its half, and after a fence the ranks read
//! each other's halves: an all-reduce on two ranks has each rank reduce the whole round
//! (one pass over both inputs); on more ranks each reduces its own slice into its half,
//! and after a second fence copies the others' reduced slices (two-shot).
//!
//! A fence is a synchronization of the caller's stream, then an exchange among the ranks,
//! so a rank reads a peer's half only once the peer's writes to it are complete. A rank
//! writes a half again only two rounds later, past a fence that every peer reaches only
//! after its reads of the previous use: no fence is needed at the end of a round.

use std::sync::Arc;

use chorus_kernels::cuda::memory::{copy_on_device, DeviceAlloc, IpcHandle, IpcMapping};
use chorus_kernels::cuda::{CudaError, CudaStream, Device};
use chorus_kernels::ReduceOp;

use super::{agree, slice, DeviceCall, Job};
use crate::env::CHORUS_CUDA_PATH;
use crate::{Communicator, Error, Result};

/// Bytes of each half of a rank's scratch buffer: the most one round moves per rank.
const HALF_BYTES: usize = 64 << 20;
/// Bytes of the record each rank publishes: a flag, the IPC handle, the host's identity.
const RECORD: usize = 128;
const HANDLE: usize = IpcHandle::LEN;
const HOST_ID: usize = RECORD - 1 - HANDLE;

/// This rank's scratch buffer and every rank's, mapped into this process.
pub(super) struct Peers {
    scratch: DeviceAlloc,
    /// The peers' scratch buffers mapped into this process (unmapped on drop).
    mapped: Vec<IpcMapping>,
    /// Every rank's scratch buffer in this process's address space (this rank's own too).
    ptrs: Vec<u64>,
    /// The half the next round uses (every rank runs the same rounds, so all agree).
    half: usize,
}

impl Peers {
    /// Sets up the IPC path on `comm`, or returns `None` where it cannot be used (then
    /// every rank returns `None`). With `forced`, fails instead, naming the rank and why.
    /// The device's context must be current.
    pub fn connect(comm: &Communicator, forced: bool) -> Result<Option<Peers>> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let exported = DeviceAlloc::new(2 * HALF_BYTES).and_then(|scratch| {
            let handle = scratch.export()?;
            Ok((scratch, handle))
        });
        let mut record = [0u8; RECORD];
        if let Ok((_, handle)) = &exported {
            record[0] = 1;
            record[1..=HANDLE].copy_from_slice(&handle.0);
        }
        record[1 + HANDLE..].copy_from_slice(&host_id());
        let mut records = vec![0u8; RECORD * world];
        comm.all_gather(&record, &mut records)?;
        let refuse = |reason: String| -> Result<Option<Peers>> {
            if forced {
                Err(Error::Config {
                    var: CHORUS_CUDA_PATH,
                    value: "ipc".into(),
                    reason,
                })
            } else {
                tracing::info!("device collectives take the staged path: {reason}");
                Ok(None)
            }
        };
        for (q, theirs) in records.chunks(RECORD).enumerate() {
            if theirs[0] != 1 {
                return refuse(format!(
                    "rank {q} cannot export device memory through CUDA IPC"
                ));
            }
            if theirs[1 + HANDLE..] != record[1 + HANDLE..] {
                return refuse(format!("rank {q} runs on another host than rank {rank}"));
            }
        }
        // This rank's own record passed the check above, so the export succeeded.
        let (scratch, _) = exported?;
        let mut ptrs = Vec::with_capacity(world);
        let mut mapped = Vec::with_capacity(world);
        let mut failure = None;
        for (q, theirs) in records.chunks(RECORD).enumerate() {
            if q == rank {
                ptrs.push(scratch.ptr());
                continue;
            }
            let mut handle = IpcHandle([0; HANDLE]);
            handle.0.copy_from_slice(&theirs[1..=HANDLE]);
            match handle.open() {
                Ok(mapping) => {
                    ptrs.push(mapping.ptr());
                    mapped.push(mapping);
                }
                Err(err) => {
                    failure.get_or_insert(format!(
                        "rank {rank} cannot map rank {q}'s device memory: {err}"
                    ));
                    ptrs.push(0);
                }
            }
        }
        let mut agreed = [u8::from(failure.is_none())];
        comm.all_reduce(&mut agreed, ReduceOp::Min)?;
        if agreed[0] == 0 {
            return refuse(
                failure
                    .unwrap_or_else(|| "another rank cannot map its peers' device memory".into()),
            );
        }
        Ok(Some(Peers {
            scratch,
            mapped,
            ptrs,
            half: 0,
        }))
    }

    /// Unmaps the peers' buffers and waits until every rank has (so the scratch buffer
    /// freed next is no longer mapped anywhere).
    pub fn close(&mut self, comm: &Communicator) {
        self.mapped.clear();
        self.ptrs.clear();
        if let Err(err) = comm.barrier() {
            tracing::warn!(%err, "closing the device communicator: barrier failed");
        }
    }

    pub fn run(
        &mut self,
        comm: &Communicator,
        device: &Device,
        job: Job,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let size = job.dtype.size();
        let room = match job.call {
            DeviceCall::ReduceScatter(_) => HALF_BYTES / comm.world_size(),
            _ => HALF_BYTES,
        };
        let step = (room / size).max(1) * size;
        for (i, offset) in (0..job.block).step_by(step).enumerate() {
            let at = (self.half * HALF_BYTES) as u64;
            self.half ^= 1;
            let round = Round {
                comm,
                device,
                stream,
                ptrs: self.ptrs.iter().map(|p| p + at).collect(),
                scratch: self.scratch.ptr() + at,
                job,
                first: i == 0,
            };
            let len = step.min(job.block - offset);
            match job.call {
                DeviceCall::AllReduce(op) => round.all_reduce(op, offset, len)?,
                DeviceCall::Broadcast { root } => round.broadcast(root, offset, len)?,
                DeviceCall::Reduce { op, root } => round.reduce(op, root, offset, len)?,
                DeviceCall::AllGather => round.all_gather(offset, len)?,
                DeviceCall::ReduceScatter(op) => round.reduce_scatter(op, offset, len)?,
            }
        }
        stream
            .synchronize()
            .map_err(CudaError::driver("waiting for the stream"))?;
        Ok(())
    }
}

struct Round<'a> {
    comm: &'a Communicator,
    device: &'a Device,
    stream: &'a Arc<CudaStream>,
    /// Every rank's half for this round.
    ptrs: Vec<u64>,
    /// This rank's half.
    scratch: u64,
    job: Job,
    /// The call's first round: its first fence checks that every rank makes this call.
    first: bool,
}

impl Round<'_> {
    fn all_reduce(&self, op: ReduceOp, offset: usize, len: usize) -> Result<()> {
        let (input, output) = self.at(offset);
        self.copy(self.scratch, input, len)?;
        self.fence(self.first)?;
        let (world, me) = (self.comm.world_size(), self.comm.rank());
        if world <= 2 {
            return self.reduce_from(op, output, 0, len);
        }
        let (start, end) = slice(len, self.job.dtype, world, me);
        let mine = output + start as u64;
        self.reduce_from(op, mine, start as u64, end - start)?;
        self.copy(self.scratch + start as u64, mine, end - start)?;
        self.fence(false)?;
        for (q, &theirs) in self.ptrs.iter().enumerate().filter(|(q, _)| *q != me) {
            let (start, end) = slice(len, self.job.dtype, world, q);
            self.copy(output + start as u64, theirs + start as u64, end - start)?;
        }
        Ok(())
    }

    fn broadcast(&self, root: usize, offset: usize, len: usize) -> Result<()> {
        let (input, output) = self.at(offset);
        if self.comm.rank() == root {
            self.copy(self.scratch, input, len)?;
            self.copy(output, input, len)?;
        }
        self.fence(self.first)?;
        if self.comm.rank() != root {
            self.copy(output, self.ptrs[root], len)?;
        }
        Ok(())
    }

    fn reduce(&self, op: ReduceOp, root: usize, offset: usize, len: usize) -> Result<()> {
        let (input, output) = self.at(offset);
        self.copy(self.scratch, input, len)?;
        self.fence(self.first)?;
        if self.comm.rank() == root {
            self.reduce_from(op, output, 0, len)?;
        }
        Ok(())
    }

    fn all_gather(&self, offset: usize, len: usize) -> Result<()> {
        let (input, _) = self.at(offset);
        self.copy(self.scratch, input, len)?;
        self.fence(self.first)?;
        for (q, &theirs) in self.ptrs.iter().enumerate() {
            let dst = self.job.output + (q * self.job.block + offset) as u64;
            let src = if q == self.comm.rank() { input } else { theirs };
            self.copy(dst, src, len)?;
        }
        Ok(())
    }

    fn reduce_scatter(&self, op: ReduceOp, offset: usize, len: usize) -> Result<()> {
        let world = self.comm.world_size();
        for q in 0..world {
            let src = self.job.input + (q * self.job.block + offset) as u64;
            self.copy(self.scratch + (q * len) as u64, src, len)?;
        }
        self.fence(self.first)?;
        let output = self.job.output + offset as u64;
        self.reduce_from(op, output, (self.comm.rank() * len) as u64, len)
    }

    /// The input and output addresses at byte `offset` of this rank's block.
    fn at(&self, offset: usize) -> (u64, u64) {
        (
            self.job.input + offset as u64,
            self.job.output + offset as u64,
        )
    }

    /// `out = op` over every rank's scratch bytes `at..at + len`, in rank order (so every
    /// rank that computes a slice computes it alike); `Avg` divides at the end.
    fn reduce_from(&self, op: ReduceOp, out: u64, at: u64, len: usize) -> Result<()> {
        let dtype = self.job.dtype;
        let sources: Vec<u64> = self.ptrs.iter().map(|p| p + at).collect();
        match sources[..] {
            [only] => self.copy(out, only, len)?,
            [a, b, ref rest @ ..] => {
                // SAFETY: every scratch buffer holds `at + len` bytes and is mapped here;
                // `out` lies in the caller's output; no peer writes its scratch before the
                // next barrier, and the stream is synchronized before that barrier.
                unsafe {
                    self.device
                        .reduce_into_raw(op, dtype, [out, a, b], len, self.stream)?;
                    for &src in rest {
                        self.device.reduce_into_raw(
                            op,
                            dtype,
                            [out, out, src],
                            len,
                            self.stream,
                        )?;
                    }
                }
            }
            [] => {}
        }
        if op == ReduceOp::Avg {
            // SAFETY: as above, `out` holds `len` bytes of the caller's output.
            unsafe {
                self.device
                    .finish_avg_raw(dtype, out, len, sources.len(), self.stream)?
            };
        }
        Ok(())
    }

    fn copy(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: the callers pass ranges inside the caller's buffers (lengths checked by
        // the communicator) or inside scratch buffers of `SCRATCH_BYTES`; the barriers
        // keep peers from writing what is being read.
        unsafe { copy_on_device(dst, src, len, self.stream)? };
        Ok(())
    }

    /// Waits for this rank's queued work, then for every rank to get there; with `check`,
    /// the meeting is `agree`'s exchange, which also checks the ranks make the same call.
    fn fence(&self, check: bool) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(CudaError::driver("waiting for the stream"))?;
        if check {
            agree(self.comm, self.job)
        } else {
            self.comm.barrier()
        }
    }
}

/// What identifies this host to its peers: the kernel's boot id (one per machine and
/// boot), else the host name, padded with zeros.
fn host_id() -> [u8; HOST_ID] {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| crate::hostname());
    let mut out = [0u8; HOST_ID];
    for (dst, src) in out.iter_mut().zip(id.bytes()) {
        *dst = src;
    }
    out
}
