//! The C entry points, with NCCL's names and signatures.
//!
//! # Safety
//!
//! The entry points that take pointers are `unsafe` to call, with NCCL's own rules: a
//! communicator is used by one thread at a time, but for `ncclCommGetAsyncError` and
//! `ncclCommAbort`, which any thread may call (a call running on a handle when another
//! thread aborts it fails, and the communicator is freed once it has); an out-pointer has
//! room for what the call writes (a split's or a shrink's inside a group, until the group's
//! `ncclGroupEnd` returns); a buffer holds the elements its count and type say and
//! stays valid, and untouched by anyone else, until the call returns (or, inside a group,
//! until its `ncclGroupEnd` returns).
//!
//! Handles are numbers looked up, never dereferenced, and never handed out twice: one
//! destroyed or aborted already, or never made here, is refused with `ncclInvalidArgument`.
//!
//! Every one catches panics and turns failures into NCCL's result codes, keeping the text
//! for `ncclGetLastError` (per thread) and, under `NCCL_DEBUG=WARN` or `INFO`, printing it.
//! Where the communicator orders calls on streams (every rank had a current CUDA device when
//! it was made, and the library was built with the `cuda` feature), a call is issued on its
//! stream and returns at once; its buffers must stay valid until the stream has passed it.
//! Elsewhere buffers are host memory, and a call returns when it is done; device memory is
//! refused there by name. A call on a stream being captured into a graph is refused.

use std::borrow::Cow;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use chorus::{Communicator, DType, Element, ReduceOp};

use crate::abi::{
    self, NcclResult, UniqueId, REVOKE_DEFAULT, SHRINK_ABORT, SPLIT_NOCOLOR, VERSION_CODE,
};
use crate::comm::{Comm, Failure, Outcome};
use crate::group::{self, Message, Op};
use crate::handles;
use crate::id::Rendezvous;
use crate::memory;
use crate::premul::{scaled, PreMulSum, Scalar, Scale};

/// `cudaStream_t`, opaque here.
pub type Stream = *mut c_void;

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

/// Keeps `text` as this thread's last error.
pub(crate) fn remember(text: &str) {
    let text = CString::new(text.replace('\0', " ")).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = text);
}

/// Whether `NCCL_DEBUG` asks for failures (`WARN`) or also Chorus's decisions (`INFO`).
fn debug(level: &str) -> bool {
    let set = std::env::var(chorus_env::NCCL_DEBUG).unwrap_or_default();
    set.eq_ignore_ascii_case(level) || (level == "WARN" && set.eq_ignore_ascii_case("INFO"))
}

/// Under `NCCL_DEBUG=INFO`, Chorus's log on standard error, once per process: each kind of
/// call's path and algorithm as the tuner picks them (unless the program logs through
/// `tracing` itself).
fn log_decisions() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if debug("INFO") {
        ONCE.call_once(|| {
            let _ = tracing_subscriber::fmt()
                .with_env_filter("chorus=info")
                .with_writer(std::io::stderr)
                .try_init();
        });
    }
}

/// Runs `body` for the entry point `call`: its result, or its failure's code (the text kept
/// and, where `NCCL_DEBUG` asks, printed), or `ncclInternalError` if it panicked. The
/// calling thread's current CUDA context is left as it was.
fn guard(call: &str, body: impl FnOnce() -> Outcome<NcclResult>) -> NcclResult {
    let _caller = memory::KeepContext::new();
    let failure = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(result)) => return result,
        Ok(Err(f)) => f,
        Err(panic) => {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Failure::new(NcclResult::InternalError, format!("panicked: {why}"))
        }
    };
    let text = format!("{call}: {}", failure.text);
    if debug("WARN") {
        eprintln!("NCCL WARN {text}");
    }
    remember(&text);
    failure.code
}

/// `guard` for a body with nothing to report but success.
fn done(call: &str, body: impl FnOnce() -> Outcome) -> NcclResult {
    guard(call, || body().map(|()| NcclResult::Success))
}

/// The communicator behind the handle `comm`, held for the call.
fn handle(comm: *const Comm) -> Outcome<Arc<Comm>> {
    handles::get(comm)
}

/// A pointer the caller must pass.
fn given<T>(ptr: *mut T, name: &str) -> Outcome<*mut T> {
    match ptr.is_null() {
        true => Err(Failure::argument(format!("{name} is NULL"))),
        false => Ok(ptr),
    }
}

/// The CUDA device current on this thread, or -1 without one.
fn current_device() -> c_int {
    memory::current_device().unwrap_or(-1)
}

/// A rank argument checked against the communicator.
fn rank_of(raw: c_int, comm: &Comm, name: &str) -> Outcome<usize> {
    usize::try_from(raw)
        .ok()
        .filter(|&r| r < comm.nranks())
        .ok_or_else(|| {
            Failure::argument(format!(
                "{name} {raw} is not a rank of this communicator of {}",
                comm.nranks()
            ))
        })
}

/// `ncclGetVersion`: 2.30.7, the NCCL whose ABI this library implements.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> NcclResult {
    done("ncclGetVersion", || {
        // SAFETY: checked non-null; the caller passes a writable int.
        unsafe { *given(version, "version")? = VERSION_CODE };
        Ok(())
    })
}

/// `ncclGetUniqueId`: starts this job's rendezvous store in this process.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut UniqueId) -> NcclResult {
    done("ncclGetUniqueId", || {
        let id = given(id, "uniqueId")?;
        let made = Rendezvous::serve().map_err(|e| Failure::new(NcclResult::SystemError, e))?;
        // SAFETY: checked non-null; the caller passes room for an id.
        unsafe { id.write(made.encode()) };
        Ok(())
    })
}

/// `ncclCommInitRank`: joins rank `rank` of `nranks`, blocking.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut *mut Comm,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
) -> NcclResult {
    // SAFETY: as this function's caller promises; no config.
    unsafe { ncclCommInitRankConfig(comm, nranks, id, rank, std::ptr::null_mut()) }
}

/// `ncclCommInitRankConfig`: joins rank `rank` of `nranks` with `config` (its `blocking`
/// honoured: a non-blocking set-up returns `ncclInProgress` and finishes in the background).
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut *mut Comm,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    config: *mut c_void,
) -> NcclResult {
    guard("ncclCommInitRankConfig", || {
        // SAFETY: as this function's caller promises.
        unsafe { init_rank(comm, nranks, id, rank, config) }
    })
}

/// `ncclCommInitRankScalable`: as `ncclCommInitRankConfig`, given `nId` unique ids that
/// every rank passes alike. Chorus's store needs one: every rank joins through the first,
/// and the stores the others started in this process close.
///
/// # Safety
/// As NCCL requires (see the module's documentation): `commIds` holds `nId` ids.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    comm: *mut *mut Comm,
    nranks: c_int,
    rank: c_int,
    n_id: c_int,
    ids: *mut UniqueId,
    config: *mut c_void,
) -> NcclResult {
    guard("ncclCommInitRankScalable", || {
        let ids = given(ids, "commIds")?;
        let n = usize::try_from(n_id)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| Failure::argument(format!("nId {n_id} is not positive")))?;
        // SAFETY: the caller passes nId ids.
        let ids = unsafe { std::slice::from_raw_parts(ids, n) };
        for other in &ids[1..] {
            drop(
                Rendezvous::decode(other)
                    .map_err(Failure::argument)?
                    .take_server(),
            );
        }
        // SAFETY: as this function's caller promises.
        unsafe { init_rank(comm, nranks, ids[0], rank, config) }
    })
}

/// Both rank-by-rank set-ups: rank `rank` of `nranks` joins the job `id` names, with `config`.
///
/// # Safety
/// As `ncclCommInitRankConfig`'s caller promises.
unsafe fn init_rank(
    comm: *mut *mut Comm,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    config: *mut c_void,
) -> Outcome<NcclResult> {
    let out = given(comm, "comm")?;
    // SAFETY: checked non-null; the caller passes room for a handle. NULL until one is made,
    // so that a failed set-up leaves no garbage for the caller's clean-up.
    unsafe { out.write(std::ptr::null_mut()) };
    // SAFETY: a config is null or made by NCCL_CONFIG_INITIALIZER, as NCCL requires.
    let settings = unsafe { abi::settings(config) }.map_err(Failure::argument)?;
    let id = Rendezvous::decode(&id).map_err(Failure::argument)?;
    let (nranks, rank) = match (usize::try_from(nranks), usize::try_from(rank)) {
        (Ok(n), Ok(r)) => (n, r),
        _ => {
            return Err(Failure::argument(format!(
                "rank {rank} of {nranks}: neither may be negative"
            )))
        }
    };
    log_decisions();
    let made = Arc::new(Comm::join(id, nranks, rank, current_device())?);
    let result = if group::open() {
        group::note_init(&made);
        NcclResult::Success
    } else if settings.blocking {
        made.communicator()?;
        NcclResult::Success
    } else {
        NcclResult::InProgress
    };
    // SAFETY: checked non-null; the caller passes room for a handle.
    unsafe { out.write(handles::publish(made)) };
    Ok(result)
}

/// `ncclCommInitAll`: `ndev` ranks in this process, one a device of `devlist` (or devices
/// 0..ndev without one), set up together.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut *mut Comm,
    ndev: c_int,
    devlist: *const c_int,
) -> NcclResult {
    done("ncclCommInitAll", || {
        let out = given(comms, "comms")?;
        let n = usize::try_from(ndev)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| Failure::argument(format!("ndev {ndev} is not positive")))?;
        for rank in 0..n {
            // SAFETY: checked non-null; the caller passes room for ndev handles, each NULL
            // until the set-up has succeeded.
            unsafe { out.add(rank).write(std::ptr::null_mut()) };
        }
        let id = Rendezvous::serve().map_err(|e| Failure::new(NcclResult::SystemError, e))?;
        log_decisions();
        let mut made = Vec::with_capacity(n);
        for rank in 0..n {
            let device = match devlist.is_null() {
                // SAFETY: a device list holds ndev entries.
                false => unsafe { *devlist.add(rank) },
                true => rank as c_int,
            };
            made.push(Arc::new(Comm::join(id, n, rank, device)?));
        }
        for comm in &made {
            comm.communicator()?;
        }
        for (rank, comm) in made.into_iter().enumerate() {
            // SAFETY: checked non-null; the caller passes room for ndev handles.
            unsafe { out.add(rank).write(handles::publish(comm)) };
        }
        Ok(())
    })
}

/// `ncclCommFinalize`: waits for the communicator's set-up and for every call issued on a
/// stream to end; fails with the first that failed.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommFinalize(comm: *mut Comm) -> NcclResult {
    done("ncclCommFinalize", || {
        let comm = &handle(comm)?;
        comm.usable()?;
        comm.joined()?.finish()
    })
}

/// `ncclCommRevoke`: stops the communicator's calls in flight, here and on every rank, and
/// every call to come, keeping the handle for `ncclCommSplit`, `ncclCommShrink` and
/// `ncclCommDestroy`; `ncclCommGetAsyncError` says `ncclInProgress` until its calls on
/// streams have ended, then `ncclSuccess`.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommRevoke(comm: *mut Comm, flags: c_int) -> NcclResult {
    done("ncclCommRevoke", || {
        let comm = &handle(comm)?;
        if flags != REVOKE_DEFAULT {
            return Err(Failure::argument(format!(
                "revokeFlags {flags:#x} is not NCCL_REVOKE_DEFAULT (0)"
            )));
        }
        comm.revoke()
    })
}

/// `ncclCommDestroy`: waits for the calls issued on streams to end (as `ncclCommFinalize`),
/// then frees the handle, closing the communicator's connections. NULL is nothing to free
/// (a `NCCL_SPLIT_NOCOLOR` rank's split), as with NCCL.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut Comm) -> NcclResult {
    done("ncclCommDestroy", || {
        if comm.is_null() {
            return Ok(());
        }
        let comm = handles::take(comm)?;
        // Their failures were the calls' to report; the handle goes either way (a set-up
        // still running goes on in the background, and ends with nothing to serve).
        if !comm.in_progress() {
            if let Ok(joined) = comm.joined() {
                let _ = joined.finish();
            }
        }
        Ok(())
    })
}

/// How long `ncclCommAbort` waits for the calls it failed to let go of the communicator.
const ABORT_GRACE: Duration = Duration::from_secs(10);

/// `ncclCommAbort`: fails every call in flight and to come, on every rank, then frees the
/// handle (NULL: nothing to do, as with NCCL). A set-up still running is not stopped: it
/// ends at its timeout, and the communicator is freed then.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: *mut Comm) -> NcclResult {
    done("ncclCommAbort", || {
        if comm.is_null() {
            return Ok(());
        }
        let comm = handles::take(comm)?;
        // Nothing this thread's open group queued runs on it, or keeps it.
        group::forget(&comm);
        if comm.abort() {
            // Freed here once the calls still running on it (another thread's) have failed,
            // as NCCL's abort frees it before it returns; a call that takes longer frees it
            // as it ends.
            handles::release(comm, ABORT_GRACE);
        }
        Ok(())
    })
}

/// `ncclCommSplit`: ranks of the same `color` form a new communicator, ordered by `key`;
/// `NCCL_SPLIT_NOCOLOR` takes no part (`*newcomm` is set to NULL). A revoked communicator
/// splits among the ranks that are still there.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommSplit(
    comm: *mut Comm,
    color: c_int,
    key: c_int,
    newcomm: *mut *mut Comm,
    config: *mut c_void,
) -> NcclResult {
    done("ncclCommSplit", || {
        let out = given(newcomm, "newcomm")?;
        // SAFETY: checked non-null; the caller passes room for a handle, NULL until one is
        // made.
        unsafe { out.write(std::ptr::null_mut()) };
        let comm = handle(comm)?;
        // SAFETY: as ncclCommInitRankConfig's.
        unsafe { abi::settings(config) }.map_err(Failure::argument)?;
        let color = match color {
            SPLIT_NOCOLOR => None,
            c => Some(u32::try_from(c).map_err(|_| {
                Failure::argument(format!("color {c} is negative and not NCCL_SPLIT_NOCOLOR"))
            })?),
        };
        // SAFETY: checked non-null; the caller keeps room for a handle until the call returns
        // (inside a group, until its end).
        unsafe {
            make_into(out, comm, move |comm| {
                let communicator = comm.communicator()?;
                Ok(match comm.revoked() {
                    // A revoked communicator takes no calls: the split runs on a fresh
                    // communicator of the ranks that are still there, agreed as a shrink's.
                    true => communicator.shrink(&[])?.split(color, i64::from(key))?,
                    false => communicator.split(color, i64::from(key))?,
                })
            })
        }
    })
}

/// `ncclCommShrink`: a new communicator of the survivors less `exclude` (ranks here), made
/// without the dead; `NCCL_SHRINK_ABORT` first aborts this one's calls in flight.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommShrink(
    comm: *mut Comm,
    exclude: *mut c_int,
    exclude_count: c_int,
    newcomm: *mut *mut Comm,
    config: *mut c_void,
    flags: c_int,
) -> NcclResult {
    done("ncclCommShrink", || {
        let out = given(newcomm, "newcomm")?;
        // SAFETY: checked non-null; the caller passes room for a handle, NULL until one is
        // made.
        unsafe { out.write(std::ptr::null_mut()) };
        let comm = handle(comm)?;
        // SAFETY: as ncclCommInitRankConfig's.
        unsafe { abi::settings(config) }.map_err(Failure::argument)?;
        let count = usize::try_from(exclude_count).map_err(|_| {
            Failure::argument(format!("excludeRanksCount {exclude_count} is negative"))
        })?;
        let exclude: Vec<usize> = match count {
            0 => Vec::new(),
            // SAFETY: the list holds excludeRanksCount ranks.
            n => unsafe { std::slice::from_raw_parts(given(exclude, "excludeRanksList")?, n) }
                .iter()
                .map(|&r| rank_of(r, &comm, "excluded rank"))
                .collect::<Outcome<_>>()?,
        };
        if flags & !SHRINK_ABORT != 0 {
            return Err(Failure::argument(format!(
                "shrinkFlags {flags:#x} has unknown bits"
            )));
        }
        // SAFETY: checked non-null; the caller keeps room for a handle until the call returns
        // (inside a group, until its end).
        unsafe {
            make_into(out, comm, move |comm| {
                let communicator = comm.communicator()?;
                if flags & SHRINK_ABORT != 0 {
                    communicator.abort();
                }
                Ok(Some(communicator.shrink(&exclude)?))
            })
        }
    })
}

/// Makes a communicator of `from` with `make` (a split or a shrink; `None`: this rank takes no
/// part) now, or at the end of this thread's open group, and writes its handle (or NULL) to
/// `out`.
///
/// # Safety
/// `out` has room for a handle until the call returns, or inside a group until its end.
unsafe fn make_into(
    out: *mut *mut Comm,
    from: Arc<Comm>,
    make: impl FnOnce(&Comm) -> Outcome<Option<Communicator>> + Send + 'static,
) -> Outcome {
    let out = out as usize;
    group::make(
        &Arc::clone(&from),
        Box::new(move || {
            let made = match make(&from)? {
                Some(c) => handles::publish(Arc::new(Comm::made(c, from.device())?)),
                None => std::ptr::null_mut(),
            };
            // SAFETY: as the function requires.
            unsafe { (out as *mut *mut Comm).write(made) };
            Ok(())
        }),
    )
}

/// `ncclGetErrorString`.
#[no_mangle]
pub extern "C" fn ncclGetErrorString(result: c_int) -> *const c_char {
    match NcclResult::from_raw(result) {
        Some(r) => r.text().as_ptr(),
        None => c"unknown result code".as_ptr(),
    }
}

/// `ncclGetLastError`: the text of this thread's last failed call (whatever `comm`); valid
/// until this thread's next failure.
#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: *mut Comm) -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

/// `ncclCommGetAsyncError`: `ncclInProgress` while a non-blocking set-up runs, then the
/// fault that broke the communicator (a dead peer, a mismatched call, a stall), if any.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(
    comm: *mut Comm,
    error: *mut NcclResult,
) -> NcclResult {
    done("ncclCommGetAsyncError", || {
        let out = given(error, "asyncError")?;
        let found = match handle(comm)?.async_error() {
            Ok(result) => result,
            Err(failure) => {
                remember(&failure.text);
                failure.code
            }
        };
        // SAFETY: checked non-null; the caller passes a writable result.
        unsafe { out.write(found) };
        Ok(())
    })
}

/// `ncclCommCount`.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: *const Comm, count: *mut c_int) -> NcclResult {
    // SAFETY: as this function's caller promises.
    unsafe {
        comm_int("ncclCommCount", comm, count, "count", |c| {
            c.nranks() as c_int
        })
    }
}

/// `ncclCommUserRank`.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: *const Comm, rank: *mut c_int) -> NcclResult {
    // SAFETY: as this function's caller promises.
    unsafe {
        comm_int("ncclCommUserRank", comm, rank, "rank", |c| {
            c.rank() as c_int
        })
    }
}

/// `ncclCommCuDevice`: the CUDA device current when the communicator was made (-1 where
/// there was none).
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: *const Comm, device: *mut c_int) -> NcclResult {
    // SAFETY: as this function's caller promises.
    unsafe { comm_int("ncclCommCuDevice", comm, device, "device", Comm::device) }
}

/// The entry point `call`: writes what `read` says of `comm` to `out` (named `name`).
///
/// # Safety
/// `out` is NULL or points to a writable int.
unsafe fn comm_int(
    call: &str,
    comm: *const Comm,
    out: *mut c_int,
    name: &str,
    read: impl FnOnce(&Comm) -> c_int,
) -> NcclResult {
    done(call, || {
        let value = read(&*handle(comm)?);
        // SAFETY: checked non-null; the caller passes a writable int.
        unsafe { *given(out, name)? = value };
        Ok(())
    })
}

/// `ncclGroupStart`.
#[no_mangle]
pub extern "C" fn ncclGroupStart() -> NcclResult {
    group::start();
    NcclResult::Success
}

/// `ncclGroupEnd`: runs the calls of the outermost group.
#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> NcclResult {
    done("ncclGroupEnd", group::end)
}

/// A buffer of the caller's, as the typed slices the collectives take.
#[derive(Clone, Copy)]
struct Buf {
    at: usize,
    count: usize,
    /// Whether it is CUDA device memory.
    device: bool,
}

/// No buffer (a root's argument off the root).
const NONE: Buf = Buf {
    at: 0,
    count: 0,
    device: false,
};

impl Buf {
    /// `count` elements of `dtype` at `ptr`: checked for a null pointer, alignment and size,
    /// and asked whether it is device memory.
    fn new(ptr: *const c_void, count: usize, dtype: DType, name: &str) -> Outcome<Buf> {
        let size = dtype.size();
        if count == 0 {
            return Ok(NONE);
        }
        if ptr.is_null() {
            return Err(Failure::argument(format!(
                "{name} is NULL for {count} elements"
            )));
        }
        if (ptr as usize) % dtype_align(dtype) != 0 {
            return Err(Failure::argument(format!(
                "{name} {ptr:p} is not aligned to its elements of {size} bytes"
            )));
        }
        count
            .checked_mul(size)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| Failure::argument(format!("{name}: {count} elements are too many")))?;
        Ok(Buf {
            at: ptr as usize,
            count,
            device: memory::is_device(ptr),
        })
    }

    fn bytes(self, dtype: DType) -> usize {
        self.count * dtype.size()
    }

    /// The elements.
    ///
    /// # Safety
    /// The caller's buffer holds `count` elements of `T` and stays valid for `'a`; nothing
    /// writes it meanwhile.
    unsafe fn get<'a, T>(self) -> &'a [T] {
        match self.count {
            0 => &[],
            // SAFETY: as the function requires; `new` checked alignment and size.
            n => unsafe { std::slice::from_raw_parts(self.at as *const T, n) },
        }
    }

    /// The elements, to write.
    ///
    /// # Safety
    /// As `get`, and nothing else reads or writes it meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get_mut<'a, T>(self) -> &'a mut [T] {
        match self.count {
            0 => &mut [],
            // SAFETY: as the function requires; `new` checked alignment and size.
            n => unsafe { std::slice::from_raw_parts_mut(self.at as *mut T, n) },
        }
    }

    /// The elements to read beside a write of `output`: borrowed where the two are apart,
    /// copied first where they share bytes (so no reference aliases the written one).
    ///
    /// # Safety
    /// As `get`.
    unsafe fn read_beside<'a, T: Clone>(self, output: Buf, dtype: DType) -> Cow<'a, [T]> {
        // SAFETY: as the function requires; the copy is made before any write begins.
        let input = unsafe { self.get::<T>() };
        match self.overlaps(output, dtype) {
            true => Cow::Owned(input.to_vec()),
            false => Cow::Borrowed(input),
        }
    }

    /// Whether two buffers share bytes.
    fn overlaps(self, other: Buf, dtype: DType) -> bool {
        let (a, b) = (
            self.at..self.at + self.bytes(dtype),
            other.at..other.at + other.bytes(dtype),
        );
        self.count > 0 && other.count > 0 && a.start < b.end && b.start < a.end
    }
}

fn dtype_align(dtype: DType) -> usize {
    dtype.size().min(8)
}

/// A reduction: one of Chorus's, or a pre-multiplied sum made on the communicator.
#[derive(Debug, Clone, Copy)]
enum Reduction {
    Builtin(ReduceOp),
    PreMulSum(PreMulSum),
}

impl Reduction {
    /// Chorus's operator, and the scalar the input is multiplied by first, if any (a
    /// scalar in device memory that cannot be read fails the call).
    ///
    /// # Safety
    /// As [`PreMulSum::scalar`].
    unsafe fn resolve<T: Element>(self) -> chorus::Result<(ReduceOp, Option<T>)> {
        match self {
            Reduction::Builtin(op) => Ok((op, None)),
            // SAFETY: as the function requires.
            Reduction::PreMulSum(p) => match unsafe { p.scalar::<T>() } {
                Ok(by) => Ok((ReduceOp::Sum, Some(by))),
                Err(e) => Err(chorus::Error::InvalidArgument(e)),
            },
        }
    }
}

/// A collective as the entry points describe it, with its operator and root.
#[derive(Debug, Clone, Copy)]
enum Collective {
    AllReduce(Reduction),
    Broadcast(usize),
    Reduce(Reduction, usize),
    AllGather,
    ReduceScatter(Reduction),
    AllToAll,
    Gather(usize),
    Scatter(usize),
}

impl Collective {
    /// The address of its pre-multiplied sum's scalar, where that is in device memory.
    #[cfg(feature = "cuda")]
    fn device_scalar(self) -> Option<usize> {
        match self {
            Collective::AllReduce(r) | Collective::Reduce(r, _) | Collective::ReduceScatter(r) => {
                match r {
                    Reduction::PreMulSum(PreMulSum {
                        scalar: Scalar::OnDevice(at),
                        ..
                    }) => Some(at),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    /// This call with its pre-multiplied sum's scalar read from host address `at` (a copy).
    #[cfg(feature = "cuda")]
    fn scalar_at(self, at: usize) -> Collective {
        let moved = |r: Reduction| match r {
            Reduction::PreMulSum(p) => Reduction::PreMulSum(PreMulSum {
                scalar: Scalar::At(at),
                ..p
            }),
            builtin => builtin,
        };
        match self {
            Collective::AllReduce(r) => Collective::AllReduce(moved(r)),
            Collective::Reduce(r, root) => Collective::Reduce(moved(r), root),
            Collective::ReduceScatter(r) => Collective::ReduceScatter(moved(r)),
            other => other,
        }
    }
}

/// Queues or runs `call` on `comm`, from `input` into `output` (as the entry point checked
/// them: equal, an all-gather's input at its rank's block of the output, or apart, but for
/// the calls that read their input from a copy), in the order of `stream`, which must not
/// be under graph capture.
fn submit(
    comm: &Arc<Comm>,
    call: Collective,
    dtype: DType,
    (input, output): (Buf, Buf),
    stream: Stream,
) -> Outcome {
    memory::not_capturing(stream)?;
    if input.count > 0 && output.count > 0 && input.device != output.device {
        let kind = |b: Buf| if b.device { "device" } else { "host" };
        return Err(Failure::argument(format!(
            "sendbuff is {} memory and recvbuff {} memory: both must be the same",
            kind(input),
            kind(output)
        )));
    }
    let stream = stream as usize;
    let issue = move |comm: &Comm| issue(comm, call, dtype, (input, output), stream);
    group::submit(comm, Op::Collective(Box::new(issue)))
}

/// Issues `call` on `stream` where the communicator orders calls on streams; runs it now
/// otherwise (host memory only).
fn issue(
    comm: &Comm,
    call: Collective,
    dtype: DType,
    (input, output): (Buf, Buf),
    stream: usize,
) -> Outcome {
    let joined = comm.joined()?;
    let device = input.device || output.device;
    #[cfg(feature = "cuda")]
    if let Some(ordered) = &joined.ordered {
        return match device {
            // A scalar in device memory is copied in on Chorus's stream, as the buffers are.
            false if call.device_scalar().is_some() => {
                // SAFETY: as below.
                unsafe { staged(ordered, call, dtype, (input, output), stream) }
            }
            false => ordered.host(
                stream,
                // SAFETY: the caller's host buffers, valid and untouched by others until the
                // call has ended on its stream (NCCL's rule).
                Box::new(move |c| unsafe { on_host(c, call, dtype, input, output) }),
            ),
            // SAFETY: the caller's device buffers, valid and written by nothing else until
            // the call has ended on its stream (NCCL's rule).
            true => unsafe { on_device(ordered, call, dtype, (input, output), stream) },
        };
    }
    let _ = stream;
    match device {
        true => Err(Failure::usage(memory::NO_DEVICE_CALLS)),
        // SAFETY: the caller's host buffers, valid and untouched by others until the call (or
        // its group) ends.
        false => unsafe { on_host(&joined.communicator, call, dtype, input, output) }
            .map_err(Failure::from),
    }
}

/// Runs `call` on host memory, on this thread.
///
/// # Safety
/// `input` and `output` address host memory holding their elements, valid and untouched by
/// anyone else until this returns.
unsafe fn on_host(
    c: &Communicator,
    call: Collective,
    dtype: DType,
    input: Buf,
    output: Buf,
) -> chorus::Result<()> {
    macro_rules! on {
        ($($dtype:ident => $T:ty),*) => {
            match dtype {
                // SAFETY: as the function requires.
                $(DType::$dtype => unsafe { run::<$T>(c, call, dtype, input, output) },)*
                #[allow(unreachable_patterns)]
                other => Err(chorus::Error::InvalidArgument(format!("no type {other:?}"))),
            }
        };
    }
    on!(F32 => f32, F64 => f64, F16 => chorus::f16, BF16 => chorus::bf16, I8 => i8,
        U8 => u8, I32 => i32, U32 => u32, I64 => i64, U64 => u64)
}

/// Issues `call` on device memory: on the device path where Chorus has one for it, else as
/// host collectives on page-locked copies.
///
/// # Safety
/// The caller's device buffers stay valid, and written by nothing else, until the call has
/// ended on its stream.
#[cfg(feature = "cuda")]
unsafe fn on_device(
    ordered: &crate::ordered::Ordered,
    call: Collective,
    dtype: DType,
    (input, output): (Buf, Buf),
    stream: usize,
) -> Outcome {
    if let Some((on, count, at)) = device_call(call, input, output, ordered.world_size()) {
        // SAFETY: as the function requires.
        return unsafe { ordered.device(on, dtype, at, count, stream) };
    }
    // SAFETY: as the function requires.
    unsafe { staged(ordered, call, dtype, (input, output), stream) }
}

/// Issues `call` as host collectives on page-locked copies of its device memory (its
/// buffers in device memory, and a pre-multiplied sum's scalar in device memory), copied
/// in and out on Chorus's work stream: Chorus's thread never waits on the device itself,
/// whose streams may be waiting for it.
///
/// # Safety
/// As [`on_device`].
#[cfg(feature = "cuda")]
unsafe fn staged(
    ordered: &crate::ordered::Ordered,
    call: Collective,
    dtype: DType,
    (input, output): (Buf, Buf),
    stream: usize,
) -> Outcome {
    use chorus::cuda::Staged;
    let on_device = |b: Buf| b.count > 0 && b.device;
    let mut memory = Vec::new();
    if on_device(input) {
        memory.push(Staged::Input(input.at as u64, input.bytes(dtype)));
    }
    if on_device(output) {
        memory.push(Staged::Output(output.at as u64, output.bytes(dtype)));
    }
    let scalar = call.device_scalar();
    if let Some(at) = scalar {
        memory.push(Staged::Input(at as u64, dtype.size()));
    }
    let on_copies = move |c: &Communicator, pieces: &mut [&mut [u8]]| {
        let mut copies = pieces.iter_mut().map(|p| p.as_mut_ptr() as usize);
        let mut host = |b: Buf| match on_device(b) {
            true => Buf {
                at: copies.next().unwrap_or_default(),
                device: false,
                ..b
            },
            false => b,
        };
        let (input, output) = (host(input), host(output));
        let call = match scalar {
            Some(_) => call.scalar_at(copies.next().unwrap_or_default()),
            None => call,
        };
        // SAFETY: the caller's host buffers, or page-locked copies of its device buffers,
        // this call's own until it ends.
        unsafe { on_host(c, call, dtype, input, output) }
    };
    // SAFETY: as the function requires.
    unsafe { ordered.staged(memory, stream, Box::new(on_copies)) }
}

/// The device path's form of `call` (the call, its count per block, the input and output
/// addresses), where it has one: the six collectives it implements, with Chorus's own
/// operators, on `world` ranks.
#[cfg(feature = "cuda")]
fn device_call(
    call: Collective,
    input: Buf,
    output: Buf,
    world: usize,
) -> Option<(chorus::cuda::DeviceCall, usize, (usize, usize))> {
    use chorus::cuda::DeviceCall as On;
    use Reduction::Builtin;
    let both = (input.at, output.at);
    Some(match call {
        Collective::AllReduce(Builtin(op)) => (On::AllReduce(op), output.count, both),
        Collective::Broadcast(root) => (On::Broadcast { root }, output.count, both),
        Collective::Reduce(Builtin(op), root) => {
            // Off the root the output stays untouched: the input stands in for a NULL one.
            let output = if output.count == 0 {
                input.at
            } else {
                output.at
            };
            (On::Reduce { op, root }, input.count, (input.at, output))
        }
        Collective::AllGather => (On::AllGather, input.count, both),
        Collective::ReduceScatter(Builtin(op)) => (On::ReduceScatter(op), output.count, both),
        // ncclAlltoAll's buffers hold `world` blocks of its count each.
        Collective::AllToAll => (On::AllToAll, input.count / world.max(1), both),
        _ => return None,
    })
}

/// Runs `call` on elements of `T`.
///
/// # Safety
/// As `submit`'s buffers.
unsafe fn run<T: Scale>(
    c: &Communicator,
    call: Collective,
    dtype: DType,
    input: Buf,
    output: Buf,
) -> chorus::Result<()> {
    use Collective::*;
    let same = input.count > 0 && input.at == output.at;
    // SAFETY: as the function requires; where the input and output may share bytes, only
    // the output is taken, or the input is copied first (`read_beside`).
    unsafe {
        match call {
            AllReduce(r) => match r.resolve::<T>()? {
                (op, None) if same => c.all_reduce(output.get_mut::<T>(), op),
                (op, None) => c.all_reduce_into(input.get::<T>(), output.get_mut::<T>(), op),
                (op, Some(by)) => {
                    let input = scaled(input.get::<T>(), by);
                    c.all_reduce_into(&input, output.get_mut::<T>(), op)
                }
            },
            Broadcast(root) if same => c.broadcast(output.get_mut::<T>(), root),
            Broadcast(root) => c.broadcast_into(input.get::<T>(), output.get_mut::<T>(), root),
            Reduce(r, root) => {
                let (op, by) = r.resolve::<T>()?;
                let input: Cow<'_, [T]> = match by {
                    None if same => return c.reduce(output.get_mut::<T>(), op, root),
                    None => Cow::Borrowed(input.get::<T>()),
                    Some(by) => Cow::Owned(scaled(input.get::<T>(), by)),
                };
                match output.count {
                    // Off the root, the output is scratch of the library's own.
                    0 => c.reduce_into(&input, &mut input.to_vec(), op, root),
                    _ => c.reduce_into(&input, output.get_mut::<T>(), op, root),
                }
            }
            AllGather if input.overlaps(output, dtype) => {
                c.all_gather_in_place(output.get_mut::<T>())
            }
            AllGather => c.all_gather(input.get::<T>(), output.get_mut::<T>()),
            ReduceScatter(r) => {
                let (op, by) = r.resolve::<T>()?;
                let input = match by {
                    None => input.read_beside::<T>(output, dtype),
                    Some(by) => Cow::Owned(scaled(input.get::<T>(), by)),
                };
                c.reduce_scatter(&input, output.get_mut::<T>(), op)
            }
            AllToAll => {
                let input = input.read_beside::<T>(output, dtype);
                c.all_to_all(&input, output.get_mut::<T>())
            }
            Gather(root) => {
                let input = input.read_beside::<T>(output, dtype);
                c.gather(&input, output.get_mut::<T>(), root)
            }
            Scatter(root) => {
                let input = input.read_beside::<T>(output, dtype);
                c.scatter(&input, output.get_mut::<T>(), root)
            }
        }
    }
}

fn parse_dtype(raw: c_int) -> Outcome<DType> {
    abi::dtype(raw).map_err(Failure::argument)
}

/// Operator `raw` for a call of `dtype` on `comm`: Chorus's, or one made on `comm`.
fn parse_op(raw: c_int, dtype: DType, comm: &Comm) -> Outcome<Reduction> {
    match abi::reduce_op(raw) {
        Ok(op) => Ok(Reduction::Builtin(op)),
        Err(_) => comm.ops().get(raw, dtype).map(Reduction::PreMulSum),
    }
}

fn count_of(count: usize, times: usize, name: &str) -> Outcome<usize> {
    count
        .checked_mul(times)
        .ok_or_else(|| Failure::argument(format!("{name}: {count} x {times} elements overflow")))
}

/// Fails unless `input` and `output` are the same buffer or apart.
fn equal_or_apart(input: Buf, output: Buf, dtype: DType) -> Outcome {
    match input.at != output.at && input.overlaps(output, dtype) {
        true => Err(Failure::argument(
            "sendbuff and recvbuff overlap without being equal",
        )),
        false => Ok(()),
    }
}

/// A buffer only the root passes: `count` elements at `ptr` there, none elsewhere.
fn on_root(
    comm: &Comm,
    root: usize,
    ptr: *const c_void,
    count: usize,
    dtype: DType,
    name: &str,
) -> Outcome<Buf> {
    match comm.rank() == root {
        true => Buf::new(ptr, count, dtype, name),
        false => Ok(NONE),
    }
}

/// `ncclAllReduce` (in place when `sendbuff == recvbuff`).
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: *mut Comm,
    stream: Stream,
) -> NcclResult {
    done("ncclAllReduce", || {
        let dtype = parse_dtype(datatype)?;
        let comm = &handle(comm)?;
        let op = parse_op(op, dtype, comm)?;
        let input = Buf::new(sendbuff, count, dtype, "sendbuff")?;
        let output = Buf::new(recvbuff, count, dtype, "recvbuff")?;
        equal_or_apart(input, output, dtype)?;
        submit(
            comm,
            Collective::AllReduce(op),
            dtype,
            (input, output),
            stream,
        )
    })
}

/// `ncclBroadcast`: `root`'s `sendbuff` into every rank's `recvbuff`.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: *mut Comm,
    stream: Stream,
) -> NcclResult {
    done("ncclBroadcast", || {
        // SAFETY: as this function's caller promises.
        unsafe { broadcast(sendbuff, recvbuff, count, datatype, root, comm, stream) }
    })
}

/// `ncclBcast`: broadcast in place.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclBcast(
    buff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: *mut Comm,
    stream: Stream,
) -> NcclResult {
    done("ncclBcast", || {
        // SAFETY: as this function's caller promises.
        unsafe { broadcast(buff, buff, count, datatype, root, comm, stream) }
    })
}

/// Both broadcasts.
///
/// # Safety
/// As `ncclBroadcast`'s caller promises.
unsafe fn broadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: *mut Comm,
    stream: Stream,
) -> Outcome {
    let dtype = parse_dtype(datatype)?;
    let comm = &handle(comm)?;
    let root = rank_of(root, comm, "root")?;
    let output = Buf::new(recvbuff, count, dtype, "recvbuff")?;
    // The input is read on the root only.
    let input = match comm.rank() == root {
        true => Buf::new(sendbuff, count, dtype, "sendbuff")?,
        false => output,
    };
    equal_or_apart(input, output, dtype)?;
    submit(
        comm,
        Collective::Broadcast(root),
        dtype,
        (input, output),
        stream,
    )
}

/// `ncclReduce`: every rank's `sendbuff` reduced into `root`'s `recvbuff` (read nowhere
/// else, and NULL there if the caller likes).
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    root: c_int,
    comm: *mut Comm,
    stream: Stream,
) -> NcclResult {
    done("ncclReduce", || {
        let dtype = parse_dtype(datatype)?;
        let comm = &handle(comm)?;
        let op = parse_op(op, dtype, comm)?;
        let root = rank_of(root, comm, "root")?;
        let input = Buf::new(sendbuff, count, dtype, "sendbuff")?;
        let output = on_root(comm, root, recvbuff, count, dtype, "recvbuff")?;
        equal_or_apart(input, output, dtype)?;
        submit(
            comm,
            Collective::Reduce(op, root),
            dtype,
            (input, output),
            stream,
        )
    })
}

/// `ncclAllGather`: every rank's `sendcount` elements, in rank order, into every
/// `recvbuff` (in place when `sendbuff` is this rank's block of it).
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: c_int,
    comm: *mut Comm,
    stream: Stream,
) -> NcclResult {
    done("ncclAllGather", || {
        let dtype = parse_dtype(datatype)?;
        let comm = &handle(comm)?;
        let input = Buf::new(sendbuff, sendcount, dtype, "sendbuff")?;
        let total = count_of(sendcount, comm.nranks(), "recvbuff")?;
        let output = Buf::new(recvbuff, total, dtype, "recvbuff")?;
        let own = output.at + comm.rank() * sendcount * dtype.size();
        if input.overlaps(output, dtype) && input.at != own {
            return Err(Failure::argument(
                "sendbuff overlaps recvbuff without being this rank's block of it",
            ));
        }
        submit(comm, Collective::AllGather, dtype, (input, output), stream)
    })
}

/// `ncclReduceScatter`: the reduction of every rank's `sendbuff` (`recvcount` elements a
/// rank), block `rank` of it into `recvbuff` (which may lie inside `sendbuff`).
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: c_int,
    op: c_int,
    comm: *mut Comm,
    stream: Stream,
) -> NcclResult {
    done("ncclReduceScatter", || {
        let dtype = parse_dtype(datatype)?;
        let comm = &handle(comm)?;
        let op = parse_op(op, dtype, comm)?;
        let total = count_of(recvcount, comm.nranks(), "sendbuff")?;
        let input = Buf::new(sendbuff, total, dtype, "sendbuff")?;
        let output = Buf::new(recvbuff, recvcount, dtype, "recvbuff")?;
        submit(
            comm,
            Collective::ReduceScatter(op),
            dtype,
            (input, output),
            stream,
        )
    })
}

/// `ncclAlltoAll`: block `q` (of `count` elements) of `sendbuff` to rank `q`, and rank `q`'s
/// into block `q` of `recvbuff`.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    comm: *mut Comm,
    stream: Stream,
) -> NcclResult {
    done("ncclAlltoAll", || {
        let dtype = parse_dtype(datatype)?;
        let comm = &handle(comm)?;
        let total = count_of(count, comm.nranks(), "buffers")?;
        let input = Buf::new(sendbuff, total, dtype, "sendbuff")?;
        let output = Buf::new(recvbuff, total, dtype, "recvbuff")?;
        submit(comm, Collective::AllToAll, dtype, (input, output), stream)
    })
}

/// `ncclGather`: every rank's `count` elements into `root`'s `recvbuff`, in rank order.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: *mut Comm,
    stream: Stream,
) -> NcclResult {
    done("ncclGather", || {
        let dtype = parse_dtype(datatype)?;
        let comm = &handle(comm)?;
        let root = rank_of(root, comm, "root")?;
        let input = Buf::new(sendbuff, count, dtype, "sendbuff")?;
        let total = count_of(count, comm.nranks(), "recvbuff")?;
        let output = on_root(comm, root, recvbuff, total, dtype, "recvbuff")?;
        submit(
            comm,
            Collective::Gather(root),
            dtype,
            (input, output),
            stream,
        )
    })
}

/// `ncclScatter`: block `q` (of `count` elements) of `root`'s `sendbuff` into rank `q`'s
/// `recvbuff`.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: *mut Comm,
    stream: Stream,
) -> NcclResult {
    done("ncclScatter", || {
        let dtype = parse_dtype(datatype)?;
        let comm = &handle(comm)?;
        let root = rank_of(root, comm, "root")?;
        let total = count_of(count, comm.nranks(), "sendbuff")?;
        let input = on_root(comm, root, sendbuff, total, dtype, "sendbuff")?;
        let output = Buf::new(recvbuff, count, dtype, "recvbuff")?;
        submit(
            comm,
            Collective::Scatter(root),
            dtype,
            (input, output),
            stream,
        )
    })
}

/// `ncclSend`: `count` elements to `peer`, matched in order with its `ncclRecv`s from here.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: *mut Comm,
    stream: Stream,
) -> NcclResult {
    done("ncclSend", || {
        // SAFETY: as this function's caller promises.
        unsafe { message(sendbuff, count, datatype, peer, comm, stream, "sendbuff") }
            .and_then(|(comm, m)| group::submit(&comm, Op::Send(m)))
    })
}

/// `ncclRecv`: `count` elements from `peer`.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: *mut Comm,
    stream: Stream,
) -> NcclResult {
    done("ncclRecv", || {
        // SAFETY: as this function's caller promises.
        unsafe { message(recvbuff, count, datatype, peer, comm, stream, "recvbuff") }
            .and_then(|(comm, m)| group::submit(&comm, Op::Recv(m)))
    })
}

/// A message's communicator and its buffer, peer and stream, checked (the stream not under
/// graph capture).
///
/// # Safety
/// As `ncclSend`'s and `ncclRecv`'s callers promise.
unsafe fn message(
    ptr: *const c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: *mut Comm,
    stream: Stream,
    name: &str,
) -> Outcome<(Arc<Comm>, Message)> {
    memory::not_capturing(stream)?;
    let dtype = parse_dtype(datatype)?;
    let comm = handle(comm)?;
    let peer = rank_of(peer, &comm, "peer")?;
    let buf = Buf::new(ptr, count, dtype, name)?;
    let message = Message {
        at: buf.at,
        bytes: buf.bytes(dtype),
        peer,
        device: buf.device,
        stream: stream as usize,
    };
    Ok((comm, message))
}

/// `ncclRedOpCreatePreMulSum`: an operator of `comm` that sums every rank's input
/// multiplied by `*scalar` (of `datatype`), read now (`ncclScalarHostImmediate`) or by each
/// call (`ncclScalarDevice`: an address in host memory here).
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut c_int,
    scalar: *mut c_void,
    datatype: c_int,
    residence: c_int,
    comm: *mut Comm,
) -> NcclResult {
    done("ncclRedOpCreatePreMulSum", || {
        let out = given(op, "op")?;
        let dtype = parse_dtype(datatype)?;
        let comm = &handle(comm)?;
        let at = Buf::new(scalar, 1, dtype, "scalar")?;
        let scalar = match residence {
            1 if at.device => {
                let mut bytes = [0u8; 8];
                memory::read_device(at.at, &mut bytes[..dtype.size()])
                    .map_err(|e| Failure::argument(format!("scalar: {e}")))?;
                Scalar::Value(bytes)
            }
            // SAFETY: `at` holds one element of `dtype` in host memory, checked.
            1 => Scalar::value(unsafe {
                std::slice::from_raw_parts(at.at as *const u8, dtype.size())
            }),
            0 if at.device => Scalar::OnDevice(at.at),
            0 => Scalar::At(at.at),
            other => {
                return Err(Failure::argument(format!(
                    "residence {other} is not an ncclScalarResidence_t"
                )))
            }
        };
        let made = comm.ops().create(PreMulSum { dtype, scalar });
        // SAFETY: checked non-null; the caller passes a writable operator.
        unsafe { out.write(made) };
        Ok(())
    })
}

/// `ncclRedOpDestroy`: forgets an operator `ncclRedOpCreatePreMulSum` made on `comm`.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclRedOpDestroy(op: c_int, comm: *mut Comm) -> NcclResult {
    done("ncclRedOpDestroy", || handle(comm)?.ops().destroy(op))
}

/// `ncclMemAlloc`: `size` bytes of device memory on the current device, or, where there is
/// no CUDA driver or no current device, page-aligned host memory (which the calls take as
/// host buffers); NULL for zero bytes.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> NcclResult {
    done("ncclMemAlloc", || {
        let out = given(ptr, "ptr")?;
        let made = memory::alloc(size)?;
        // SAFETY: checked non-null; the caller passes room for a pointer.
        unsafe { out.write(made) };
        Ok(())
    })
}

/// `ncclMemFree`: frees what `ncclMemAlloc` returned (nothing for NULL).
///
/// # Safety
/// As NCCL requires (see the module's documentation): `ptr` is NULL or from `ncclMemAlloc`,
/// freed once, and no call in flight uses it.
#[no_mangle]
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> NcclResult {
    done("ncclMemFree", || memory::free(ptr))
}

/// `ncclCommRegister`: host buffers need no registration; the handle names the buffer.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommRegister(
    comm: *const Comm,
    buff: *mut c_void,
    _size: usize,
    registered: *mut *mut c_void,
) -> NcclResult {
    done("ncclCommRegister", || {
        handle(comm)?;
        // SAFETY: checked non-null; the caller passes room for a handle.
        unsafe { given(registered, "handle")?.write(buff) };
        Ok(())
    })
}

/// `ncclCommDeregister`.
///
/// # Safety
/// As NCCL requires (see the module's documentation).
#[no_mangle]
pub unsafe extern "C" fn ncclCommDeregister(
    comm: *const Comm,
    _registered: *mut c_void,
) -> NcclResult {
    done("ncclCommDeregister", || handle(comm).map(drop))
}

/// The text an entry point this library cannot honour fails with.
fn unsupported(call: &CStr) -> NcclResult {
    done(&call.to_string_lossy(), || {
        Err(Failure::usage(
            "not supported by Chorus's NCCL library (see docs/nccl.md for what is)",
        ))
    })
}

/// Entry points NCCL programs may import that this library does not honour: each fails with
/// `ncclInvalidUsage`, naming itself, so a program that calls one learns which.
macro_rules! unsupported {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {
        $(
            #[doc = concat!("`", stringify!($name), "`: not supported; fails with `ncclInvalidUsage`.")]
            #[no_mangle]
            pub extern "C" fn $name($(_: $ty),*) -> NcclResult {
                unsupported(&CString::new(stringify!($name)).unwrap_or_default())
            }
        )*
    };
}

unsupported! {
    ncclCommGetUniqueId(a: *mut Comm, b: *mut UniqueId);
    ncclCommGrow(a: *mut Comm, b: c_int, c: *const UniqueId, d: c_int, e: *mut *mut Comm, f: *mut c_void);
    ncclCommSuspend(a: *mut Comm, b: c_int);
    ncclCommResume(a: *mut Comm);
    ncclCommMemStats(a: *mut Comm, b: c_int, c: *mut u64);
    ncclCommWindowRegister(a: *mut Comm, b: *mut c_void, c: usize, d: *mut *mut c_void, e: c_int);
    ncclCommWindowDeregister(a: *mut Comm, b: *mut c_void);
    ncclWinGetUserPtr(a: *mut Comm, b: *mut c_void, c: *mut *mut c_void);
    ncclPutSignal(a: *const c_void, b: usize, c: c_int, d: c_int, e: *mut c_void, f: usize, g: c_int, h: c_int, i: u32, j: *mut Comm, k: Stream);
    ncclSignal(a: c_int, b: c_int, c: c_int, d: u32, e: *mut Comm, f: Stream);
    ncclWaitSignal(a: c_int, b: *mut c_void, c: *mut Comm, d: Stream);
    ncclGroupSimulateEnd(a: *mut c_void);
    ncclDevCommCreate(a: *mut Comm, b: *const c_void, c: *mut c_void);
    ncclDevCommDestroy(a: *mut Comm, b: *const c_void);
    ncclCommQueryProperties(a: *mut Comm, b: *mut c_void);
    ncclGetLsaMultimemDevicePointer(a: *mut c_void, b: usize, c: *mut *mut c_void);
    ncclGetPeerDevicePointer(a: *mut c_void, b: usize, c: c_int, d: *mut *mut c_void);
}
