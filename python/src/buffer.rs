//! A tensor's memory as an address and a length, checked against its element type.

use std::ptr::NonNull;

use chorus::DType;
use pyo3::exceptions::PyValueError;
use pyo3::PyResult;

/// `bytes` bytes at `ptr`, aligned for the element type it was made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Raw {
    ptr: usize,
    pub bytes: usize,
}

/// An input that is either the caller's memory or a copy of it.
pub(crate) enum Input {
    /// The caller's memory.
    Borrowed(Raw),
    /// A copy, made because the input overlapped the output (8-byte words keep any element
    /// type aligned).
    Copied(Vec<u64>, usize),
}

impl Raw {
    /// Checks that `bytes` is a whole number of `dtype` elements and `ptr` is aligned for them.
    pub fn new(ptr: usize, bytes: usize, dtype: DType) -> PyResult<Raw> {
        let size = dtype.size();
        if bytes % size != 0 {
            return Err(PyValueError::new_err(format!(
                "{bytes} bytes are not a whole number of {dtype} elements"
            )));
        }
        if bytes > 0 && (ptr == 0 || ptr % size != 0) {
            return Err(PyValueError::new_err(format!(
                "address {ptr:#x} is not aligned for {dtype} elements"
            )));
        }
        Ok(Raw { ptr, bytes })
    }

    /// An input and an output buffer of `dtype`, each checked as [`Raw::new`] does.
    pub fn pair(
        input: usize,
        input_bytes: usize,
        output: usize,
        output_bytes: usize,
        dtype: DType,
    ) -> PyResult<(Raw, Raw)> {
        Ok((
            Raw::new(input, input_bytes, dtype)?,
            Raw::new(output, output_bytes, dtype)?,
        ))
    }

    /// The memory as elements of `T`.
    ///
    /// # Safety
    /// The memory must be valid for reads and writes of `T` for `'a`, and not otherwise
    /// referenced meanwhile; `T` must be the element type `self` was checked for.
    pub unsafe fn slice<'a, T>(self) -> &'a mut [T] {
        let len = self.bytes / std::mem::size_of::<T>();
        if len == 0 {
            return &mut [];
        }
        // SAFETY: non-null and aligned (checked in `new`); validity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, len) }
    }

    /// The memory as bytes, to be read.
    ///
    /// # Safety
    /// The memory must be valid for reads for `'a` and not written meanwhile.
    pub unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.bytes == 0 {
            return &[];
        }
        // SAFETY: non-null (checked in `new`); validity is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.bytes) }
    }

    /// Block `index` of `len` bytes, if it lies inside.
    pub fn block(self, index: usize, len: usize) -> Option<Raw> {
        let start = index.checked_mul(len)?;
        (start.checked_add(len)? <= self.bytes).then_some(Raw {
            ptr: self.ptr + start,
            bytes: len,
        })
    }

    /// Whether the two share a byte.
    pub fn overlaps(self, other: Raw) -> bool {
        self.bytes > 0
            && other.bytes > 0
            && self.ptr < other.ptr + other.bytes
            && other.ptr < self.ptr + self.bytes
    }

    /// This memory, or a copy of it when it overlaps `other`'s (so the two can be borrowed
    /// at once).
    ///
    /// # Safety
    /// When it overlaps `other`, the memory must be valid for reads of `bytes` bytes.
    pub unsafe fn apart_from(self, other: Raw) -> Input {
        if !self.overlaps(other) {
            return Input::Borrowed(self);
        }
        let mut copy = vec![0u64; self.bytes.div_ceil(8)];
        // SAFETY: `self` is valid for reads of `bytes` bytes (the caller's promise), and the
        // fresh copy holds at least that many.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr as *const u8,
                copy.as_mut_ptr().cast::<u8>(),
                self.bytes,
            );
        }
        Input::Copied(copy, self.bytes)
    }
}

impl Input {
    /// The input's memory.
    pub fn as_ref(&self) -> Raw {
        match self {
            Input::Borrowed(raw) => *raw,
            Input::Copied(copy, bytes) => Raw {
                ptr: NonNull::from(copy.as_slice()).cast::<u64>().as_ptr() as usize,
                bytes: *bytes,
            },
        }
    }
}
