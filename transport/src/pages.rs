//! The pages under a buffer: asking the kernel for transparent huge pages, and finding out
//! how much of a range sits on them.
//!
//! A copy between processes pins every page it touches, so what a large message costs
//! depends on the pages of the buffer it is in: 4 KiB pages or 2 MiB ones. Linux tells
//! which through the `PAGEMAP_SCAN` ioctl on `/proc/self/pagemap` (Linux 6.7 and later),
//! which walks the page tables of a range and reports the runs of huge pages in it, in a
//! few microseconds a megabyte of small pages and far less on huge ones.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// The size of a base page on the platforms Chorus runs on.
const PAGE: usize = 4096;
/// The size of a transparent huge page there.
const HUGE: usize = 2 << 20;

/// Asks the kernel to back the whole pages of `memory` with transparent huge pages
/// (`madvise(MADV_HUGEPAGE)`), as numpy does for its arrays; best before anything touches
/// them. A hint only: where THP is off (`/sys/kernel/mm/transparent_hugepage/enabled`)
/// nothing changes.
pub fn advise_huge<T>(memory: &[T]) {
    let start = (memory.as_ptr() as usize).next_multiple_of(PAGE);
    let end = (memory.as_ptr() as usize + std::mem::size_of_val(memory)) & !(PAGE - 1);
    if end > start {
        // SAFETY: MADV_HUGEPAGE on whole pages inside this allocation changes only how the
        // kernel backs them, never what they hold.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

/// How many bytes of `memory`'s pages are huge pages (rounded out to whole base pages);
/// opens this process's pagemap for the one scan (see [`Pagemap`] to keep it open).
///
/// Fails with [`io::ErrorKind::Unsupported`] where the kernel cannot tell (before Linux
/// 6.7, or `/proc` not mounted).
pub fn huge_bytes<T>(memory: &[T]) -> io::Result<usize> {
    Pagemap::open()?.huge_bytes(memory)
}

/// Whether `memory` lies on huge pages (see [`Pagemap::on_huge_pages`]); opens this
/// process's pagemap for the one question.
pub fn on_huge_pages<T>(memory: &[T]) -> io::Result<bool> {
    match memory.is_empty() {
        true => Ok(false),
        false => Pagemap::open()?.on_huge_pages(memory),
    }
}

/// This process's page tables, open to scans (`/proc/self/pagemap`): a file descriptor
/// for as long as it lives.
#[derive(Debug)]
pub struct Pagemap {
    file: File,
    /// The process that opened it: a forked child's scans would describe its parent.
    pid: u32,
}

impl Pagemap {
    /// Opens this process's pagemap; fails with [`io::ErrorKind::Unsupported`] where
    /// `/proc` is not mounted.
    pub fn open() -> io::Result<Pagemap> {
        let file = File::open("/proc/self/pagemap").map_err(|_| unsupported())?;
        let pid = std::process::id();
        Ok(Pagemap { file, pid })
    }

    /// How many bytes of `memory`'s pages are huge pages (rounded out to whole base pages).
    ///
    /// Fails with [`io::ErrorKind::Unsupported`] where the kernel cannot tell (before
    /// Linux 6.7).
    pub fn huge_bytes<T>(&self, memory: &[T]) -> io::Result<usize> {
        let (start, end) = pages_of(memory);
        let mut regions = [Region::default(); 16];
        let mut scan = Scan::new(start, end, &mut regions);
        let mut huge = 0;
        loop {
            let found = scan.next(self)?;
            huge += found
                .iter()
                .map(|r| (r.end - r.start) as usize)
                .sum::<usize>();
            if found.len() < scan.arg.vec_len as usize || scan.arg.walk_end >= scan.arg.end {
                return Ok(huge);
            }
            scan.arg.start = scan.arg.walk_end;
        }
    }

    /// Whether `memory` lies on huge pages: every whole 2 MiB frame inside it, or, where it
    /// spans none, every page it touches. The ends outside whole frames do not count, as a
    /// large array's first and last megabytes seldom sit on huge pages.
    ///
    /// Two walks of the page tables, the first stopping at the first small page: a few
    /// microseconds.
    ///
    /// Fails as [`huge_bytes`](Self::huge_bytes) does.
    pub fn on_huge_pages<T>(&self, memory: &[T]) -> io::Result<bool> {
        let (at, len) = (memory.as_ptr() as usize, std::mem::size_of_val(memory));
        if len == 0 {
            // An empty slice's address need not be mapped at all.
            return Ok(false);
        }
        let (mut start, mut end) = (at.next_multiple_of(HUGE), (at + len) & !(HUGE - 1));
        if start >= end {
            (start, end) = pages_of(memory);
        }
        let mut region = [Region::default()];
        let mut scan = Scan::new(start, end, &mut region);
        // The first page that is not huge, if any.
        scan.arg.category_inverted = PAGE_IS_HUGE;
        scan.arg.max_pages = 1;
        if !scan.next(self)?.is_empty() {
            return Ok(false);
        }
        // None; but the walk says nothing of what it skips (device memory mapped by a
        // driver), so the first page must be seen to be huge too.
        let mut scan = Scan::new(start, start + PAGE, &mut region);
        Ok(!scan.next(self)?.is_empty())
    }
}

/// The base pages `memory` touches, as a range of addresses.
fn pages_of<T>(memory: &[T]) -> (usize, usize) {
    let start = memory.as_ptr() as usize & !(PAGE - 1);
    let end = (memory.as_ptr() as usize + std::mem::size_of_val(memory)).next_multiple_of(PAGE);
    (start, end)
}

/// One `PAGEMAP_SCAN` of this process's pages, reporting runs of pages in `regions`;
/// by default it looks for huge pages.
struct Scan<'a> {
    arg: ScanArg,
    regions: &'a mut [Region],
}

impl Scan<'_> {
    fn new(start: usize, end: usize, regions: &mut [Region]) -> Scan<'_> {
        let arg = ScanArg {
            size: std::mem::size_of::<ScanArg>() as u64,
            start: start as u64,
            end: end as u64,
            vec: regions.as_mut_ptr() as u64,
            vec_len: regions.len() as u64,
            category_mask: PAGE_IS_HUGE,
            return_mask: PAGE_IS_HUGE,
            ..ScanArg::default()
        };
        Scan { arg, regions }
    }

    /// Walks from `arg.start` until `regions` is full, `max_pages` are found or the range
    /// ends (`arg.walk_end` tells where it stopped); returns the runs found.
    fn next(&mut self, pagemap: &Pagemap) -> io::Result<&[Region]> {
        if pagemap.pid != std::process::id() {
            return Err(io::Error::other(
                "a pagemap opened before a fork describes the parent's pages",
            ));
        }
        // SAFETY: `arg` is a valid `pm_scan_arg` whose `vec` points at `regions`, which
        // holds `vec_len` entries; the ioctl only reads page tables of this process.
        let found = unsafe { libc::ioctl(pagemap.file.as_raw_fd(), PAGEMAP_SCAN, &mut self.arg) };
        match found {
            n if n >= 0 => Ok(&self.regions[..n as usize]),
            _ => {
                let error = io::Error::last_os_error();
                Err(match error.raw_os_error() {
                    Some(libc::ENOTTY) => unsupported(),
                    _ => error,
                })
            }
        }
    }
}

fn unsupported() -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        "the kernel cannot tell a range's page sizes (PAGEMAP_SCAN needs Linux 6.7)",
    )
}

/// `PAGEMAP_SCAN`: `_IOWR('f', 16, struct pm_scan_arg)` of Linux's `linux/fs.h`.
const PAGEMAP_SCAN: libc::Ioctl = (3 << 30 | (96 << 16) | (b'f' as u32) << 8 | 16) as libc::Ioctl;
/// The category of pages that are parts of huge pages.
const PAGE_IS_HUGE: u64 = 1 << 6;

/// `struct pm_scan_arg`.
#[repr(C)]
#[derive(Default)]
struct ScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `struct page_region`: a run of pages of the same categories.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Region {
    start: u64,
    end: u64,
    categories: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This machine's transparent huge page setting: `always`, `madvise` or `never`.
    fn thp() -> String {
        let enabled = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
        let enabled = enabled.unwrap_or_default();
        let chosen = enabled.split('[').nth(1).and_then(|s| s.split(']').next());
        chosen.unwrap_or("never").to_string()
    }

    #[test]
    fn the_scan_tells_huge_pages_from_small_ones() {
        const LEN: usize = 16 << 20;
        let small = vec![1u8; LEN];
        let Some(huge) = supported(huge_bytes(&small)) else {
            return;
        };
        if thp() != "always" {
            assert_eq!(huge, 0, "memory nobody advised is on small pages");
        }
        let mut advised = vec![0u8; LEN];
        advise_huge(&advised);
        advised.fill(1);
        let got = huge_bytes(&advised).expect("a scan");
        match thp().as_str() {
            // The whole 2 MiB pages inside the buffer: all but at most one at each end.
            "always" | "madvise" => {
                assert!(got >= LEN - (4 << 20), "{got} of {LEN} bytes on huge pages")
            }
            other => eprintln!("transparent huge pages are {other} here: {got} bytes on them"),
        }
        assert!(got <= LEN + 2 * PAGE);
    }

    #[test]
    fn a_buffer_is_on_huge_pages_when_its_whole_frames_are() {
        const LEN: usize = 16 << 20;
        let small = vec![1u8; LEN];
        let Some(on_small) = supported(on_huge_pages(&small)) else {
            return;
        };
        if thp() != "always" {
            assert!(!on_small, "memory nobody advised is on small pages");
        }
        let mut advised = vec![0u8; LEN];
        advise_huge(&advised);
        advised.fill(1);
        let whole = on_huge_pages(&advised).expect("a scan");
        let frame = advised.as_ptr().align_offset(HUGE);
        let frames = &advised[frame..frame + (LEN - frame) / HUGE * HUGE];
        let huge = huge_bytes(frames).expect("a scan");
        assert_eq!(
            whole,
            huge == frames.len(),
            "{huge} of {} bytes",
            frames.len()
        );
        if !whole {
            eprintln!(
                "not on huge pages here (THP {}): {huge} of {LEN} bytes",
                thp()
            );
            return;
        }
        // A message inside one 2 MiB frame, and one that spans no whole frame.
        assert!(on_huge_pages(&advised[frame + 4096..frame + 8192]).expect("a scan"));
        assert!(on_huge_pages(&advised[frame + 4096..frame + HUGE + 8192]).expect("a scan"));
        // Splitting one frame into small pages is seen, wherever it lies.
        let middle = frame + 3 * HUGE;
        let split = &advised[middle..middle + HUGE];
        // SAFETY: MADV_NOHUGEPAGE on whole pages of this buffer changes only how they are
        // backed, and MADV_DONTNEED on its first page zeroes it (written again below).
        unsafe {
            libc::madvise(split.as_ptr() as *mut _, HUGE, libc::MADV_NOHUGEPAGE);
            libc::madvise(split.as_ptr() as *mut _, PAGE, libc::MADV_DONTNEED);
        }
        advised[middle] = 2;
        assert!(!on_huge_pages(&advised).expect("a scan"));
        assert!(!on_huge_pages(&advised[..middle + HUGE]).expect("a scan"));
        // Bytes that miss a few of the frame's do not hold it whole.
        assert!(on_huge_pages(&advised[..middle + HUGE - 16]).expect("a scan"));
    }

    /// `Some` of a scan's result, or `None` after saying why the kernel cannot scan.
    fn supported<T>(scan: io::Result<T>) -> Option<T> {
        match scan {
            Err(e) if e.kind() == io::ErrorKind::Unsupported => {
                eprintln!("SKIPPED: {e}");
                None
            }
            other => Some(other.expect("a scan")),
        }
    }

    #[test]
    fn an_empty_range_has_no_huge_pages() {
        match huge_bytes::<u8>(&[]) {
            Ok(bytes) => assert_eq!(bytes, 0),
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::Unsupported),
        }
        assert!(!on_huge_pages::<u8>(&[]).unwrap());
        // Memory no one has touched has no pages yet.
        let untouched = vec![0u8; 16 << 20];
        if let Some(huge) = supported(on_huge_pages(&untouched)) {
            assert!(!huge);
        }
    }
}
