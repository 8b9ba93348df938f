//! The caller's memory for one call, as the real driver reaches it.

use std::marker::PhantomData;
use std::ops::Range;

use chorus_transport::pages::Pagemap;

use crate::schedule::Buf;
use crate::Error;

/// The caller's memory, borrowed for `'a`: raw because the transport reads and writes it
/// in the background while this thread works on other regions.
pub struct Buffers<'a> {
    pub(super) input: *const u8,
    pub(super) input_len: usize,
    /// Where the input lies in the output (`Some(0)`: in place), or `None`: apart from it.
    pub(super) input_at: Option<usize>,
    pub(super) output: *mut u8,
    pub(super) output_len: usize,
    /// Whether sends from the input and from the output are lent: peers on this host read
    /// them where they lie ([`Payload::Lend`](chorus_transport::Payload::Lend)).
    pub(super) lent: [bool; 2],
    /// Whether the call writes the output with streaming stores (see
    /// [`reduce_into_streaming`](chorus_kernels::reduce_into_streaming)).
    pub(super) streamed: bool,
    /// Holds the caller's borrows for as long as the pointers are in use.
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> Buffers<'a> {
    /// The caller's input (`None`: the output serves as input, in place) and output.
    pub fn new(input: Option<&'a [u8]>, output: &'a mut [u8]) -> Buffers<'a> {
        let (input, input_len, input_at) = input
            .map_or((output.as_ptr(), output.len(), Some(0)), |i| {
                (i.as_ptr(), i.len(), None)
            });
        Buffers {
            input,
            input_len,
            input_at,
            output: output.as_mut_ptr(),
            output_len: output.len(),
            lent: [false; 2],
            streamed: false,
            _borrow: PhantomData,
        }
    }

    /// In place with the input inside the output: `len` bytes from byte `offset`.
    ///
    /// Panics if the input would reach past the output (callers check the sizes).
    pub fn inside(output: &'a mut [u8], offset: usize, len: usize) -> Buffers<'a> {
        assert!(
            offset + len <= output.len(),
            "input block outside the output"
        );
        // SAFETY: `offset + len <= output.len()`, checked above.
        let input = unsafe { output.as_ptr().add(offset) };
        Buffers {
            input,
            input_len: len,
            input_at: Some(offset),
            output: output.as_mut_ptr(),
            output_len: output.len(),
            lent: [false; 2],
            streamed: false,
            _borrow: PhantomData,
        }
    }

    /// Which of the buffers lie on huge pages (input, output; see
    /// [`Pagemap::on_huge_pages`]); a kernel that cannot tell leaves them on small ones.
    pub(crate) fn on_huge_pages(&self, pagemap: &Pagemap) -> [bool; 2] {
        let (input, output) = self.addresses();
        let huge = |at: Range<usize>| {
            // SAFETY: the range is one of the caller's slices, borrowed for `'a`; the scan
            // reads only the page tables under it, never its bytes.
            let bytes = unsafe { std::slice::from_raw_parts(at.start as *const u8, at.len()) };
            pagemap.on_huge_pages(bytes).unwrap_or(false)
        };
        if input == output {
            // In place: one buffer, asked about once.
            let both = huge(output);
            return [both, both];
        }
        [huge(input), huge(output)]
    }

    /// Lends sends from the input and from the output as `lent` says.
    pub(crate) fn lend(&mut self, lent: [bool; 2]) {
        self.lent = lent;
    }

    /// Writes the output with streaming stores: every reduction into it and every receive
    /// into it over shared memory (see `streaming.rs` for when a call does).
    pub(crate) fn stream(&mut self, streamed: bool) {
        self.streamed = streamed;
    }

    /// Whether sends from `buf` are lent (never from the scratch).
    pub(super) fn lends(&self, buf: Buf) -> bool {
        match buf {
            Buf::Input => self.lent[0],
            Buf::Output => self.lent[1],
            Buf::Scratch => false,
        }
    }

    /// The addresses of the input's and the output's bytes (equal when in place).
    pub(crate) fn addresses(&self) -> (Range<usize>, Range<usize>) {
        let (input, output) = (self.input as usize, self.output as usize);
        (
            input..input + self.input_len,
            output..output + self.output_len,
        )
    }

    /// The input as a slice.
    ///
    /// # Safety
    ///
    /// No mutable slice of the input (nor, in place, of the output) may be
    /// alive while it is, and no request may be writing it.
    pub(crate) unsafe fn input(&self) -> &[u8] {
        // SAFETY: the pointer and length come from a slice borrowed for `'a`, which
        // outlives `self`; the absence of writers is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.input, self.input_len) }
    }

    /// The start and length of the output.
    pub(crate) fn output_raw(&self) -> (*mut u8, usize) {
        (self.output, self.output_len)
    }

    /// Input and output of equal length (reductions, broadcast); fails naming both lengths.
    pub fn same_len(input: Option<&'a [u8]>, output: &'a mut [u8]) -> Result<Buffers<'a>, Error> {
        match input {
            Some(i) if i.len() != output.len() => Err(Error::InvalidArgument(format!(
                "input has {} bytes but output has {}",
                i.len(),
                output.len()
            ))),
            _ => Ok(Buffers::new(input, output)),
        }
    }
}
