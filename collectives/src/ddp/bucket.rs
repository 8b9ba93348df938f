//! Buckets: which parameters share one all-reduce, and the flat buffer that holds their gradients.

use crate::{Communicator, DType, Element, Error, Result, SharedBuffer};

/// Bytes in a MiB.
const MIB: f64 = (1 << 20) as f64;

/// The first bucket's cap and the later buckets' cap, given in MiB, in bytes.
///
/// Fails unless both are positive, finite numbers.
pub(crate) fn caps_in_bytes(first_mb: f64, cap_mb: f64) -> Result<(usize, usize)> {
    for (what, mb) in [("bucket_cap_mb", cap_mb), ("first_bucket_cap_mb", first_mb)] {
        if !(mb > 0.0 && mb.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "{what} must be a positive number of MiB, not {mb}"
            )));
        }
    }
    Ok(((first_mb * MIB) as usize, (cap_mb * MIB) as usize))
}

/// One registered parameter: its name, element count and gradient type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// The name errors use (e.g. `fc1.weight`).
    pub name: String,
    /// Number of elements.
    pub len: usize,
    /// Element type of the gradient (a float type).
    pub dtype: DType,
}

impl ParamSpec {
    /// A parameter of `len` elements of `dtype`.
    pub fn new(name: impl Into<String>, len: usize, dtype: DType) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            len,
            dtype,
        }
    }

    fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }
}

impl std::fmt::Display for ParamSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "'{}' ({} x {})", self.name, self.len, self.dtype)
    }
}

/// Groups parameters into buckets, PyTorch's way: walking them in reverse
/// registration order (the order backward produces gradients), one open
/// bucket per dtype, closed once it holds at least its cap — `first_cap`
/// bytes for a dtype's first bucket, `cap` after. Buckets are returned in
/// the order their gradients become ready; each lists parameter indices in
/// its layout order.
pub(crate) fn assign(params: &[ParamSpec], first_cap: usize, cap: usize) -> Vec<Vec<usize>> {
    struct Open {
        dtype: DType,
        members: Vec<usize>,
        bytes: usize,
        closed: usize,
    }
    let mut open: Vec<Open> = Vec::new();
    let mut done: Vec<Vec<usize>> = Vec::new();
    for (i, p) in params.iter().enumerate().rev() {
        let at = match open.iter().position(|o| o.dtype == p.dtype) {
            Some(at) => at,
            None => {
                open.push(Open {
                    dtype: p.dtype,
                    members: Vec::new(),
                    bytes: 0,
                    closed: 0,
                });
                open.len() - 1
            }
        };
        let o = &mut open[at];
        o.members.push(i);
        o.bytes += p.bytes();
        let limit = if o.closed == 0 { first_cap } else { cap };
        if o.bytes >= limit {
            done.push(std::mem::take(&mut o.members));
            o.bytes = 0;
            o.closed += 1;
        }
    }
    done.extend(
        open.into_iter()
            .map(|o| o.members)
            .filter(|m| !m.is_empty()),
    );
    // Ready order: the bucket holding the latest-registered parameter first.
    done.sort_by_key(|m| std::cmp::Reverse(m.iter().copied().max().unwrap_or(0)));
    done
}

/// A flat gradient buffer of `len` elements of `dtype`, aligned for any element type.
///
/// Parameters' gradients are views into it, and it travels whole to the
/// communicator's worker for the all-reduce.
#[derive(Debug)]
pub(crate) struct Flat {
    words: Words,
    dtype: DType,
    len: usize,
}

/// A flat buffer's memory: this process's, or mapped by every rank of a one-host job.
#[derive(Debug)]
enum Words {
    Private(Vec<u64>),
    Shared(SharedBuffer<u64>),
}

impl Flat {
    /// A zeroed buffer.
    pub(crate) fn zeros(dtype: DType, len: usize) -> Flat {
        let words = (len * dtype.size()).div_ceil(8);
        Flat {
            words: Words::Private(vec![0; words]),
            dtype,
            len,
        }
    }

    /// A zeroed buffer from [`Communicator::alloc_shared`] (collective), so
    /// all-reduces on it within one host go through shared memory directly.
    pub(crate) fn shared(comm: &Communicator, dtype: DType, len: usize) -> Result<Flat> {
        let words = (len * dtype.size()).div_ceil(8);
        Ok(Flat {
            words: Words::Shared(comm.alloc_shared(words)?),
            dtype,
            len,
        })
    }

    fn words(&self) -> &[u64] {
        match &self.words {
            Words::Private(v) => v,
            Words::Shared(s) => s,
        }
    }

    fn words_mut(&mut self) -> &mut [u64] {
        match &mut self.words {
            Words::Private(v) => v,
            Words::Shared(s) => s,
        }
    }

    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// The elements as `T`, which must be the buffer's type.
    pub(crate) fn typed<T: Element>(&self) -> &[T] {
        debug_assert_eq!(T::DTYPE, self.dtype);
        &bytemuck::cast_slice(self.words())[..self.len]
    }

    /// The elements as `T`, which must be the buffer's type.
    pub(crate) fn typed_mut<T: Element>(&mut self) -> &mut [T] {
        debug_assert_eq!(T::DTYPE, self.dtype);
        let len = self.len;
        &mut bytemuck::cast_slice_mut(self.words_mut())[..len]
    }

    /// Sets every element to zero.
    pub(crate) fn clear(&mut self) {
        self.words_mut().fill(0);
    }

    /// Zeroes elements `range` (element indices).
    pub(crate) fn clear_range(&mut self, range: std::ops::Range<usize>) {
        let size = self.dtype.size();
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(self.words_mut());
        bytes[range.start * size..range.end * size].fill(0);
    }
}

impl<T: Element> AsMut<[T]> for Flat {
    fn as_mut(&mut self) -> &mut [T] {
        self.typed_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(lens: &[usize]) -> Vec<ParamSpec> {
        lens.iter()
            .enumerate()
            .map(|(i, &len)| ParamSpec::new(format!("p{i}"), len, DType::F32))
            .collect()
    }

    #[test]
    fn buckets_fill_in_reverse_order_with_a_small_first_bucket() {
        // Caps in bytes: first 40 (10 floats), then 80 (20 floats).
        let params = f32s(&[8, 8, 8, 8, 8, 4, 4]);
        let buckets = assign(&params, 40, 80);
        // Reverse: p6(4) p5(4) p4(8) -> 16 floats >= 10: close; p3 p2 p1 -> 24 >= 20: close; p0.
        assert_eq!(buckets, vec![vec![6, 5, 4], vec![3, 2, 1], vec![0]]);
    }

    #[test]
    fn the_default_caps_put_the_whole_mnist_mlp_in_one_bucket_as_pytorch_does() {
        let params = f32s(&[784 * 256, 256, 256 * 128, 128, 128 * 10, 10]);
        let buckets = assign(&params, 1 << 20, 25 << 20);
        assert_eq!(buckets, vec![vec![5, 4, 3, 2, 1, 0]]);
    }

    #[test]
    fn each_dtype_gets_its_own_buckets() {
        let params = vec![
            ParamSpec::new("a", 4, DType::F32),
            ParamSpec::new("b", 4, DType::BF16),
            ParamSpec::new("c", 4, DType::F32),
            ParamSpec::new("d", 4, DType::BF16),
        ];
        let buckets = assign(&params, 1 << 20, 1 << 20);
        assert_eq!(buckets, vec![vec![3, 1], vec![2, 0]]);
        // A parameter larger than the cap gets a bucket of its own.
        let buckets = assign(&f32s(&[100, 1, 100]), 8, 8);
        assert_eq!(buckets, vec![vec![2], vec![1, 0]]);
    }

    #[test]
    fn flat_buffers_view_any_element_type() {
        let mut f = Flat::zeros(DType::BF16, 5);
        assert_eq!(f.typed::<crate::bf16>().len(), 5);
        f.typed_mut::<crate::bf16>()[4] = crate::bf16::ONE;
        f.clear_range(0..4);
        assert_eq!(f.typed::<crate::bf16>()[4], crate::bf16::ONE);
        f.clear();
        assert!(f
            .typed::<crate::bf16>()
            .iter()
            .all(|v| *v == crate::bf16::ZERO));
    }
}
