//! Windows: memory that every local rank maps, one segment per rank, so a
//! collective on it reads and writes peers' buffers directly (like memory
//! from `ncclMemAlloc` or `MPI_Win_allocate_shared`).
//!
//! The lowest local rank creates one file holding every segment and
//! publishes its name; the others map it and say so, and the creator
//! unlinks it once all have, as for the transport's own region.
//!
//! [`Window::bytes`] and [`Window::bytes_mut`] are how a collective touches a
//! peer's segment: bounds are checked here, and the caller promises, with
//! meetings, that nobody writes what it reads or touches what it writes.

use std::ops::Range;
use std::path::PathBuf;

use memmap2::MmapRaw;

use super::setup::{self, Unlink};
use super::ShmTransport;
use crate::store::Store;
use crate::TransportError;

/// Segments are whole pages.
const PAGE: usize = 4096;

/// Shared memory of the local ranks: a segment of [`len`](Self::len) bytes each.
///
/// Holds the mapping: every pointer it hands out is valid while it lives.
#[derive(Debug)]
pub struct Window {
    id: u64,
    map: MmapRaw,
    len: usize,
    segment: usize,
    own_local: usize,
    locals: usize,
}

impl Window {
    /// The id every local rank allocated it under.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes of each rank's segment.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the segments are empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of segments (local ranks).
    pub fn locals(&self) -> usize {
        self.locals
    }

    /// The start of local rank `local`'s segment ([`len`](Self::len) bytes).
    ///
    /// Panics if `local` is not a local rank.
    pub fn segment(&self, local: usize) -> *mut u8 {
        assert!(local < self.locals, "local rank {local} outside the window");
        // SAFETY: `local * segment + segment <= map.len()`, the mapping's size.
        unsafe { self.map.as_mut_ptr().add(local * self.segment) }
    }

    /// The start of this rank's own segment.
    pub fn own(&self) -> *mut u8 {
        self.segment(self.own_local)
    }

    /// Bytes `range` of local rank `local`'s segment, to read.
    ///
    /// Panics if `local` is not a local rank or `range` leaves the segment.
    ///
    /// # Safety
    /// While the slice lives, no rank (in this process or another) writes those bytes:
    /// callers order their reads and writes with meetings.
    pub unsafe fn bytes(&self, local: usize, range: Range<usize>) -> &[u8] {
        let at = self.start_of(local, &range);
        // SAFETY: `range` lies in the segment (checked), which the mapping holds while
        // `self` lives; the caller rules out writers.
        unsafe { std::slice::from_raw_parts(at, range.len()) }
    }

    /// Bytes `range` of local rank `local`'s segment, to write.
    ///
    /// Panics if `local` is not a local rank or `range` leaves the segment.
    ///
    /// # Safety
    /// While the slice lives, no rank (in this process or another) reads or writes those
    /// bytes through anything else: callers order their reads and writes with meetings.
    #[allow(clippy::mut_from_ref)] // shared memory: exclusivity is the caller's contract
    pub unsafe fn bytes_mut(&self, local: usize, range: Range<usize>) -> &mut [u8] {
        let at = self.start_of(local, &range);
        // SAFETY: `range` lies in the segment (checked), which the mapping holds while
        // `self` lives; the caller rules out every other access.
        unsafe { std::slice::from_raw_parts_mut(at, range.len()) }
    }

    /// Where `range` of local rank `local`'s segment starts; panics unless it lies inside.
    fn start_of(&self, local: usize, range: &Range<usize>) -> *mut u8 {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "bytes {range:?} outside a segment of {}",
            self.len
        );
        // SAFETY: `range.start <= len`, within the segment.
        unsafe { self.segment(local).add(range.start) }
    }
}

impl ShmTransport {
    /// Allocates window `id`: `len` bytes of shared memory for every local
    /// rank, each mapped by all of them. Every local rank must call it with
    /// the same `id` and `len`; the memory starts zeroed.
    ///
    /// Fails if the file cannot be created, sized or mapped (a full
    /// `/dev/shm`), if ranks ask for different sizes (naming both), or if a
    /// local rank does not map it within the set-up timeout.
    pub fn allocate_window(
        &self,
        id: u64,
        len: usize,
        store: &dyn Store,
    ) -> Result<Window, TransportError> {
        let (rank, leader) = (self.rank, self.local[0]);
        let segment = len.div_ceil(PAGE).max(1) * PAGE;
        let locals = self.local.len();
        let total = segment.checked_mul(locals).ok_or_else(|| {
            TransportError::Setup(format!(
                "rank {rank}: a shared buffer of {len} bytes per rank is too large"
            ))
        });
        let key = |what: &str| format!("shm/{leader}/window/{id}/{what}");
        // Every way out tells the others, so nobody waits out the timeout, and
        // every rank returns an error when any fails.
        let map = if rank == leader {
            let made = total.and_then(|total| {
                let (path, file) = setup::create(&self.config.dir, total)?;
                let created = Unlink(path);
                Ok((setup::map(&file, &created.0)?, created))
            });
            let told = match &made {
                Ok((_, created)) => format!("{len} {}", created.0.to_string_lossy()),
                Err(e) => format!("error {e}"),
            };
            store.set(&key("path"), told.as_bytes())?;
            let (map, created) = made?;
            store.set(&key(&format!("mapped/{rank}")), b"1")?;
            let keys: Vec<String> = self
                .local
                .iter()
                .map(|r| key(&format!("mapped/{r}")))
                .collect();
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            if let Err(e) = store.wait(&keys, self.config.timeout) {
                // Those that did map wait for a verdict: give them one.
                store.set(&key("verdict"), format!("{e}").as_bytes())?;
                return Err(e.into());
            }
            drop(created);
            let mut failed = Vec::new();
            for &r in &self.local {
                if store.get(&key(&format!("mapped/{r}")))? != b"1" {
                    failed.push(r.to_string());
                }
            }
            if failed.is_empty() {
                store.set(&key("verdict"), b"ok")?;
            } else {
                let why = format!(
                    "ranks [{}] could not map it (see their errors)",
                    failed.join(", ")
                );
                store.set(&key("verdict"), why.as_bytes())?;
                return Err(TransportError::Setup(format!("shared buffer {id}: {why}")));
            }
            map
        } else {
            let mapped = total.and_then(|total| self.open_window(len, total, &key("path"), store));
            let said: &[u8] = if mapped.is_ok() { b"1" } else { b"0" };
            store.set(&key(&format!("mapped/{rank}")), said)?;
            let map = mapped?;
            let verdict = store.get(&key("verdict"))?;
            if verdict != b"ok" {
                return Err(TransportError::Setup(format!(
                    "shared buffer {id} failed on rank {leader}: {}",
                    String::from_utf8_lossy(&verdict)
                )));
            }
            map
        };
        Ok(Window {
            id,
            map,
            len,
            segment,
            own_local: self.own_local,
            locals,
        })
    }

    /// Maps the window another local rank created and published under `key`.
    fn open_window(
        &self,
        len: usize,
        total: usize,
        key: &str,
        store: &dyn Store,
    ) -> Result<MmapRaw, TransportError> {
        let (rank, leader) = (self.rank, self.local[0]);
        let raw = store.get(key)?;
        let told = String::from_utf8_lossy(&raw).into_owned();
        if let Some(why) = told.strip_prefix("error ") {
            return Err(TransportError::Setup(format!(
                "rank {leader} could not create a shared buffer: {why}"
            )));
        }
        let bad = || TransportError::Setup(format!("rank {leader} published a bad window: {told}"));
        let (theirs, path) = told.split_once(' ').ok_or_else(bad)?;
        let theirs: usize = theirs.parse().map_err(|_| bad())?;
        if theirs != len {
            return Err(TransportError::Setup(format!(
                "rank {rank} asked for a shared buffer of {len} bytes, rank {leader} for {theirs}"
            )));
        }
        let path = PathBuf::from(path);
        let map = setup::map(&setup::open(&path, rank, leader)?, &path)?;
        if map.len() < total {
            return Err(TransportError::Setup(format!(
                "rank {rank}: the shared-buffer file {} of rank {leader} has {} bytes, expected {total}",
                path.display(),
                map.len()
            )));
        }
        Ok(map)
    }
}
