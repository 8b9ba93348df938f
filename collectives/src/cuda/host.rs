//! Host collectives on device memory: the memory copied through a page-locked host buffer
//! around the call, inside the stream order (see [`CudaCommunicator::staged_call_raw`]).

use std::sync::Arc;

use chorus_kernels::cuda::memory::{copy_to_device, copy_to_host, Pinned};

use super::{CallerStream, CudaCommunicator, CudaError, CudaStream, DeviceWork, Shared};
use crate::communicator::lock;
use crate::{Communicator, Result};

/// Device memory a host call works on, for [`CudaCommunicator::staged_call_raw`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Staged {
    /// `bytes` bytes at a device address that the call reads: copied to the host before it.
    Input(u64, usize),
    /// `bytes` bytes at a device address that the call writes: copied back after it.
    Output(u64, usize),
}

impl Staged {
    fn bytes(self) -> usize {
        match self {
            Staged::Input(_, bytes) | Staged::Output(_, bytes) => bytes,
        }
    }
}

/// Where each piece of `memory` sits in one host buffer (each on a 64-byte boundary, so
/// aligned for every element type), and the buffer's length.
fn layout(memory: &[Staged]) -> (Vec<usize>, usize) {
    let mut at = 0;
    let offsets = memory
        .iter()
        .map(|m| {
            let offset = at;
            at = (at + m.bytes()).next_multiple_of(64);
            offset
        })
        .collect();
    (offsets, at)
}

/// Page-locked host memory for staged calls, kept while the communicator lives and grown
/// as calls need it: freeing page-locked memory can wait for the whole device, whose
/// streams may wait for calls that only Chorus's thread, the one freeing, would run.
#[derive(Default)]
pub(super) struct HostStage {
    /// The buffer calls use, and its length.
    buffer: Option<(Pinned, usize)>,
    /// Outgrown buffers, freed with the communicator (once no stream waits on its calls).
    outgrown: Vec<Pinned>,
}

impl HostStage {
    /// The buffer, grown to at least `len` bytes (to a power of two) where it is smaller.
    fn at_least(&mut self, len: usize) -> Result<&mut Pinned> {
        if self.buffer.as_ref().is_none_or(|&(_, has)| has < len) {
            let has = len.next_power_of_two();
            let grown = (Pinned::new(has)?, has);
            self.outgrown
                .extend(self.buffer.replace(grown).map(|(old, _)| old));
        }
        Ok(&mut self.buffer.as_mut().expect("a buffer, made above").0)
    }
}

/// Runs `call` on host copies of `memory`, on Chorus's thread once the call's start has
/// passed: inputs are copied in on the work stream first, outputs copied back after.
pub(super) fn run_staged<F>(shared: &Shared, memory: &[Staged], call: F) -> Result<()>
where
    F: FnOnce(&Communicator, &mut [&mut [u8]]) -> Result<()>,
{
    shared
        .device
        .context()
        .bind_to_thread()
        .map_err(CudaError::driver("binding the device's context"))?;
    let (offsets, len) = layout(memory);
    let mut stage = lock(&shared.host_stage);
    let host = stage.at_least(len)?;
    let ran = through(shared, memory, (&offsets, len), host, call);
    // The copies enqueued read and write `host` and the caller's memory: they have all
    // run before the next call uses `host` and this one returns, even where it failed
    // halfway.
    let settled = shared
        .work
        .synchronize()
        .map_err(CudaError::driver("waiting for the copies to the device"));
    ran.and(settled.map_err(Into::into))
}

/// [`run_staged`]'s copies and call through `host`, a buffer of `len` bytes holding each
/// piece of `memory` at its offset; returns with the last copies enqueued on the work stream.
fn through<F>(
    shared: &Shared,
    memory: &[Staged],
    (offsets, len): (&[usize], usize),
    host: &mut Pinned,
    call: F,
) -> Result<()>
where
    F: FnOnce(&Communicator, &mut [&mut [u8]]) -> Result<()>,
{
    let work = &shared.work;
    for (&m, &at) in memory.iter().zip(offsets) {
        if let Staged::Input(src, bytes) = m {
            // SAFETY: `src` holds `bytes` bytes of device memory until the call has ended
            // (the caller's promise); `host` has room for them at `at` and is read only
            // after the copy has run.
            unsafe { copy_to_host(host.at(at), src, bytes, work)? };
        }
    }
    work.synchronize()
        .map_err(CudaError::driver("waiting for the copies to the host"))?;
    let mut pieces = Vec::with_capacity(memory.len());
    let mut rest = host.bytes_mut(len);
    for (i, m) in memory.iter().enumerate() {
        let next = offsets.get(i + 1).copied().unwrap_or(len);
        let (piece, tail) = std::mem::take(&mut rest).split_at_mut(next - offsets[i]);
        pieces.push(&mut piece[..m.bytes()]);
        rest = tail;
    }
    call(&shared.comm, &mut pieces)?;
    drop(pieces);
    for (&m, &at) in memory.iter().zip(offsets) {
        if let Staged::Output(dst, bytes) = m {
            // SAFETY: `dst` holds `bytes` bytes of device memory until the call has ended,
            // written by nothing else meanwhile (the caller's promise); `host` outlives the
            // copy, which [`run_staged`] waits for.
            unsafe { copy_to_device(dst, host.at(at), bytes, work)? };
        }
    }
    Ok(())
}

impl CudaCommunicator {
    /// Runs `call`, collectives on host memory (as [`host_call`](Self::host_call) does), on
    /// host copies of the device memory `memory` describes: each [`Staged::Input`] is copied
    /// into a page-locked host buffer once the work queued on `stream` before the call has
    /// ended, `call` gets one host slice per piece of `memory`, in order, each aligned for
    /// any element type, and each [`Staged::Output`] is copied back to the device after it.
    /// This is how collectives that run on the host (all-to-all, gather, scatter,
    /// point-to-point) take device buffers, in the stream order. `keep` comes back through
    /// the handle once the call has ended.
    ///
    /// # Safety
    /// Every piece of `memory` must be device memory of this communicator's device of at
    /// least its length, allocated until the call has ended (until [`DeviceWork::wait`]
    /// returns, or a stream ordered after the call has passed it), and nothing else may
    /// write an output piece meanwhile.
    pub unsafe fn staged_call_raw<K, F>(
        &self,
        memory: Vec<Staged>,
        (stream, caller): (&Arc<CudaStream>, CallerStream),
        keep: K,
        call: F,
    ) -> DeviceWork<K>
    where
        K: Send + 'static,
        F: FnOnce(&Communicator, &mut [&mut [u8]]) -> Result<()> + Send + 'static,
    {
        self.on_host((stream, caller), keep, move |shared| {
            run_staged(shared, &memory, call)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_sit_apart_on_aligned_offsets() {
        let memory = [
            Staged::Input(0x1000, 10),
            Staged::Output(0x2000, 0),
            Staged::Output(0x3000, 64),
            Staged::Input(0x4000, 3),
        ];
        let (offsets, len) = layout(&memory);
        assert_eq!(offsets, vec![0, 64, 64, 128]);
        assert_eq!(len, 192);
        for (m, at) in memory.iter().zip(&offsets) {
            assert_eq!(at % 64, 0);
            assert!(at + m.bytes() <= len);
        }
    }
}
