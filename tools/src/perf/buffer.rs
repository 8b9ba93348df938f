//! Byte buffers aligned for every element type, so typed collectives can view them.

use chorus::{Communicator, SharedBuffer};

/// An 8-byte-aligned byte buffer: private and growable, or shared with the
/// other ranks (`-R`) and of fixed size.
#[derive(Debug)]
pub enum Buffer {
    /// This process's memory.
    Private(Vec<u64>),
    /// From [`Communicator::alloc_shared`].
    Shared(SharedBuffer<u64>),
}

impl Default for Buffer {
    fn default() -> Self {
        Buffer::Private(Vec::new())
    }
}

impl Buffer {
    /// A zeroed private buffer of at least `len` bytes; with `huge_pages`, advised to be
    /// backed by transparent huge pages, as numpy does for its arrays (`--hugepages`).
    pub fn zeroed(len: usize, huge_pages: bool) -> Buffer {
        // Zeroed memory this big comes fresh from the kernel, untouched: the advice
        // applies to every page as it is first touched.
        let words = vec![0; len.div_ceil(8)];
        if huge_pages {
            chorus::pages::advise_huge(&words);
        }
        Buffer::Private(words)
    }

    /// A zeroed shared buffer of at least `len` bytes; every rank must ask for the same size.
    pub fn shared(comm: &Communicator, len: usize) -> Result<Buffer, String> {
        comm.alloc_shared(len.div_ceil(8))
            .map(Buffer::Shared)
            .map_err(|e| format!("cannot allocate a shared buffer of {len} bytes: {e}"))
    }

    fn words(&self) -> &[u64] {
        match self {
            Buffer::Private(v) => v,
            Buffer::Shared(s) => s,
        }
    }

    /// The first `len` bytes.
    ///
    /// Panics if the buffer is shorter: callers size it first.
    pub fn bytes(&self, len: usize) -> &[u8] {
        &bytemuck::cast_slice(self.words())[..len]
    }

    /// The first `len` bytes, growing a private buffer (with zeros) if it is shorter.
    ///
    /// Panics if a shared buffer is shorter: callers size it first.
    pub fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        let words: &mut [u64] = match self {
            Buffer::Private(v) => {
                if v.len() * 8 < len {
                    v.resize(len.div_ceil(8), 0);
                }
                v
            }
            Buffer::Shared(s) => s,
        };
        &mut bytemuck::cast_slice_mut(words)[..len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_stays_aligned() {
        let mut b = Buffer::zeroed(3, false);
        assert_eq!(b.bytes(3), &[0, 0, 0]);
        b.bytes_mut(20).fill(7);
        assert_eq!(b.bytes(20).len(), 20);
        assert_eq!(b.bytes(20).as_ptr() as usize % 8, 0);
        let floats: &[f64] = bytemuck::cast_slice(b.bytes(16));
        assert_eq!(floats.len(), 2);
    }

    #[test]
    fn huge_page_buffers_are_zeroed_and_usable() {
        let mut b = Buffer::zeroed(8 << 20, true);
        assert!(b.bytes(8 << 20).iter().all(|&x| x == 0));
        b.bytes_mut(8 << 20).fill(3);
        assert!(b.bytes(8 << 20).iter().all(|&x| x == 3));
    }
}
