//! Byte buffers aligned for every element type, so typed collectives can view them.

/// A growable byte buffer with 8-byte alignment.
#[derive(Debug, Default)]
pub struct Buffer(Vec<u64>);

impl Buffer {
    /// A zeroed buffer of at least `len` bytes.
    pub fn zeroed(len: usize) -> Buffer {
        Buffer(vec![0; len.div_ceil(8)])
    }

    /// The first `len` bytes.
    ///
    /// Panics if the buffer is shorter: callers size it first.
    pub fn bytes(&self, len: usize) -> &[u8] {
        &bytemuck::cast_slice(&self.0)[..len]
    }

    /// The first `len` bytes, growing the buffer (with zeros) if it is shorter.
    pub fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        if self.0.len() * 8 < len {
            self.0.resize(len.div_ceil(8), 0);
        }
        &mut bytemuck::cast_slice_mut(&mut self.0)[..len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_stays_aligned() {
        let mut b = Buffer::zeroed(3);
        assert_eq!(b.bytes(3), &[0, 0, 0]);
        b.bytes_mut(20).fill(7);
        assert_eq!(b.bytes(20).len(), 20);
        assert_eq!(b.bytes(20).as_ptr() as usize % 8, 0);
        let floats: &[f64] = bytemuck::cast_slice(b.bytes(16));
        assert_eq!(floats.len(), 2);
    }
}
