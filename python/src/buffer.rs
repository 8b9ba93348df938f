//! A tensor's memory as an address and a length, checked against its element type, and held
//! for the length of an asynchronous call.

use std::marker::PhantomData;

use chorus::DType;
use pyo3::exceptions::PyValueError;
use pyo3::{Py, PyAny, PyResult};

/// `bytes` bytes at `ptr`, aligned for the element type it was made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Raw {
    ptr: usize,
    pub bytes: usize,
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

    /// The address, as a device address (a CUDA tensor's memory).
    #[cfg(feature = "cuda")]
    pub fn addr(self) -> u64 {
        self.ptr as u64
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

    /// The memory as elements of `T`, to be read.
    ///
    /// # Safety
    /// The memory must be valid for reads of `T` for `'a` and not written meanwhile; `T` must
    /// be the element type `self` was checked for.
    pub unsafe fn shared<'a, T>(self) -> &'a [T] {
        let len = self.bytes / std::mem::size_of::<T>();
        if len == 0 {
            return &[];
        }
        // SAFETY: non-null and aligned (checked in `new`); validity is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr as *const T, len) }
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
}

/// Tensor memory an asynchronous call owns until it is done: the address and length, a
/// private copy where the call needs one, and the Python objects that keep the memory alive
/// (released when the call is done, on whichever thread: pyo3 defers the release until the
/// interpreter is next entered).
pub(crate) struct Held<T> {
    raw: Raw,
    /// The copy `raw` points into, when the call reads a copy of the caller's memory.
    _copy: Option<Vec<u64>>,
    _keep: Option<Py<PyAny>>,
    _element: PhantomData<fn() -> T>,
}

// SAFETY: a `Held` is the only handle on its memory for the call's length (`new`'s
// contract), so moving it to the worker thread moves sole use of that memory.
unsafe impl<T> Send for Held<T> {}

impl<T> Held<T> {
    /// Holds `raw` for a call, with `keep` owning it.
    ///
    /// # Safety
    /// `raw` must have been checked for `T`, and stay valid for reads and writes, and not
    /// otherwise referenced (but by the same call's other buffers, which only read it), until
    /// the `Held` is dropped.
    pub unsafe fn new(raw: Raw, keep: Option<Py<PyAny>>) -> Held<T> {
        Held {
            raw,
            _copy: None,
            _keep: keep,
            _element: PhantomData,
        }
    }

    /// Holds the input `raw` of a call whose output is `output`: a copy of it when the two
    /// overlap, so that the call may read one while it writes the other.
    ///
    /// # Safety
    /// As [`Held::new`], but for reads only: the call never writes through an input.
    pub unsafe fn input(raw: Raw, output: Raw, keep: Option<Py<PyAny>>) -> Held<T> {
        if !raw.overlaps(output) {
            // SAFETY: the caller's promise.
            return unsafe { Held::new(raw, keep) };
        }
        let mut copy = vec![0u64; raw.bytes.div_ceil(8)];
        // SAFETY: `raw` is valid for reads of `bytes` bytes (the caller's promise), and the
        // fresh copy holds at least that many.
        unsafe {
            std::ptr::copy_nonoverlapping(
                raw.ptr as *const u8,
                copy.as_mut_ptr().cast::<u8>(),
                raw.bytes,
            );
        }
        Held {
            // 8-byte words keep any element type aligned.
            raw: Raw {
                ptr: copy.as_mut_ptr() as usize,
                bytes: raw.bytes,
            },
            _copy: Some(copy),
            _keep: keep,
            _element: PhantomData,
        }
    }
}

/// A call's input and separate output, held as [`Held::input`] and [`Held::new`] hold them,
/// `keep` owning both.
///
/// # Safety
/// As [`Held::input`] for `input` and [`Held::new`] for `output`.
pub(crate) unsafe fn held_apart<T>(input: Raw, output: Raw, keep: Py<PyAny>) -> (Held<T>, Held<T>) {
    // SAFETY: the caller's promises.
    unsafe {
        (
            Held::input(input, output, None),
            Held::new(output, Some(keep)),
        )
    }
}

impl<T> AsRef<[T]> for Held<T> {
    fn as_ref(&self) -> &[T] {
        // SAFETY: valid and checked for `T` while `self` lives (`new`'s contract); only read
        // for as long as `self` is borrowed shared.
        unsafe { self.raw.shared::<T>() }
    }
}

impl<T> AsMut<[T]> for Held<T> {
    fn as_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `as_ref`, and `self` is borrowed uniquely.
        unsafe { self.raw.slice::<T>() }
    }
}
