//! NCCL's types as its header (2.30.7) lays them out: what crosses the C boundary.
//!
//! Enums that callers pass in (data types, reduction operators) arrive as plain `c_int`s and
//! are checked here; a Rust enum would make an out-of-range value undefined behaviour.

use std::ffi::{c_char, c_int, c_uint, c_void};

use chorus::{DType, ReduceOp};

/// The NCCL version whose ABI this library implements: 2.30.7, as `ncclGetVersion` encodes
/// it (`major * 10000 + minor * 100 + patch` from 2.9 on).
pub const VERSION_CODE: c_int = 23007;

/// Bytes of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `NCCL_SPLIT_NOCOLOR`: the rank takes no part in the split.
pub const SPLIT_NOCOLOR: c_int = -1;

/// `NCCL_SHRINK_ABORT`: abort the calls in flight before shrinking.
pub const SHRINK_ABORT: c_int = 0x01;

/// `NCCL_REVOKE_DEFAULT`: the only flags `ncclCommRevoke` takes.
pub const REVOKE_DEFAULT: c_int = 0;

/// `NCCL_API_MAGIC`, which `NCCL_CONFIG_INITIALIZER` writes into a config.
pub const API_MAGIC: c_uint = 0xcafe_beef;

/// `NCCL_CONFIG_UNDEF_INT`: a config field left to the library.
pub const UNDEF_INT: c_int = c_int::MIN;

/// `ncclResult_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NcclResult {
    /// `ncclSuccess`.
    Success = 0,
    /// `ncclUnhandledCudaError`.
    UnhandledCudaError = 1,
    /// `ncclSystemError`.
    SystemError = 2,
    /// `ncclInternalError`.
    InternalError = 3,
    /// `ncclInvalidArgument`.
    InvalidArgument = 4,
    /// `ncclInvalidUsage`.
    InvalidUsage = 5,
    /// `ncclRemoteError`.
    RemoteError = 6,
    /// `ncclInProgress`.
    InProgress = 7,
    /// `ncclTimeout` (2.30.3 on).
    Timeout = 8,
}

impl NcclResult {
    /// The result a C value names, if any.
    pub fn from_raw(raw: c_int) -> Option<NcclResult> {
        use NcclResult::*;
        [
            Success,
            UnhandledCudaError,
            SystemError,
            InternalError,
            InvalidArgument,
            InvalidUsage,
            RemoteError,
            InProgress,
            Timeout,
        ]
        .into_iter()
        .find(|r| *r as c_int == raw)
    }

    /// `ncclGetErrorString`'s text.
    pub fn text(self) -> &'static std::ffi::CStr {
        match self {
            NcclResult::Success => c"no error",
            NcclResult::UnhandledCudaError => c"unhandled cuda error (NCCL_DEBUG=INFO for details)",
            NcclResult::SystemError => c"unhandled system error (NCCL_DEBUG=INFO for details)",
            NcclResult::InternalError => c"internal error",
            NcclResult::InvalidArgument => c"invalid argument (NCCL_DEBUG=WARN for details)",
            NcclResult::InvalidUsage => c"invalid usage (NCCL_DEBUG=WARN for details)",
            NcclResult::RemoteError => c"remote process exited or there was a network error",
            NcclResult::InProgress => c"NCCL operation in progress",
            NcclResult::Timeout => c"timeout",
        }
    }
}

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    /// The bytes (see [`crate::id`]).
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// The Chorus element type of NCCL data type `raw`; the 8-bit floats have none.
pub fn dtype(raw: c_int) -> Result<DType, String> {
    Ok(match raw {
        0 => DType::I8,
        1 => DType::U8,
        2 => DType::I32,
        3 => DType::U32,
        4 => DType::I64,
        5 => DType::U64,
        6 => DType::F16,
        7 => DType::F32,
        8 => DType::F64,
        9 => DType::BF16,
        10 | 11 => {
            return Err(format!(
            "data type {raw} (ncclFloat8{}) is not supported: Chorus has no 8-bit float kernels",
            if raw == 10 { "e4m3" } else { "e5m2" }
        ))
        }
        _ => return Err(format!("data type {raw} is not an ncclDataType_t")),
    })
}

/// The Chorus reduction of NCCL operator `raw` (the built-in ones: sum, prod, max, min, avg).
pub fn reduce_op(raw: c_int) -> Result<ReduceOp, String> {
    Ok(match raw {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Prod,
        2 => ReduceOp::Max,
        3 => ReduceOp::Min,
        4 => ReduceOp::Avg,
        _ => {
            return Err(format!(
                "reduction operator {raw} is not one this communicator knows"
            ))
        }
    })
}

/// What this library reads of an `ncclConfig_t`: the caller's header may be older (a smaller
/// struct, fields it lacks keep their defaults) or newer (fields past ours are not read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// `blocking`: calls wait for the communicator's set-up (1, the default), or return
    /// `ncclInProgress` and set it up in the background (0).
    pub blocking: bool,
    /// `commName`, for logs.
    pub name: Option<String>,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            blocking: true,
            name: None,
        }
    }
}

/// Byte offsets of the fields read, on LP64: `size`, `magic`, `version`, `blocking`,
/// `commName` (2.27 on).
const MAGIC_AT: usize = 8;
const VERSION_AT: usize = 12;
const BLOCKING_AT: usize = 16;
const NAME_AT: usize = 48;

/// The settings of the `ncclConfig_t` at `config` (defaults for a null pointer).
///
/// # Safety
/// `config` is null or points to a config of at least the `size` it states (as
/// `NCCL_CONFIG_INITIALIZER` writes it), whose `commName`, if set, is a C string.
pub unsafe fn settings(config: *const c_void) -> Result<Settings, String> {
    let mut settings = Settings::default();
    if config.is_null() {
        return Ok(settings);
    }
    let base = config.cast::<u8>();
    // SAFETY: every config starts with `size`, `magic` and `version` (16 bytes).
    let (size, magic, version) = unsafe {
        (
            base.cast::<usize>().read_unaligned(),
            base.add(MAGIC_AT).cast::<c_uint>().read_unaligned(),
            base.add(VERSION_AT).cast::<c_uint>().read_unaligned(),
        )
    };
    if magic != API_MAGIC {
        return Err(format!(
            "the ncclConfig_t was not set up with NCCL_CONFIG_INITIALIZER (magic {magic:#x})"
        ));
    }
    // A field is the caller's when its struct holds it and its header had it.
    let has = |at: usize, bytes: usize, since: c_uint| at + bytes <= size && version >= since;
    if has(BLOCKING_AT, 4, 21400) {
        // SAFETY: inside the caller's `size` bytes.
        match unsafe { base.add(BLOCKING_AT).cast::<c_int>().read_unaligned() } {
            0 => settings.blocking = false,
            1 | UNDEF_INT => {}
            other => return Err(format!("ncclConfig_t.blocking is {other}, not 0 or 1")),
        }
    }
    if has(NAME_AT, 8, 22700) {
        // SAFETY: inside the caller's `size` bytes; a set name is a C string.
        let name = unsafe { base.add(NAME_AT).cast::<*const c_char>().read_unaligned() };
        if !name.is_null() {
            // SAFETY: as above.
            let name = unsafe { std::ffi::CStr::from_ptr(name) };
            settings.name = Some(name.to_string_lossy().into_owned());
        }
    }
    Ok(settings)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config as a 2.30.7 header's initializer writes it, with `blocking` and `commName`.
    #[repr(C)]
    struct Config {
        size: usize,
        magic: c_uint,
        version: c_uint,
        blocking: c_int,
        ints: [c_int; 3],
        net_name: *const c_char,
        split_share: c_int,
        traffic_class: c_int,
        comm_name: *const c_char,
        rest: [c_int; 10],
    }

    fn config(size: usize, version: c_uint, blocking: c_int, name: *const c_char) -> Config {
        Config {
            size,
            magic: API_MAGIC,
            version,
            blocking,
            ints: [UNDEF_INT; 3],
            net_name: std::ptr::null(),
            split_share: UNDEF_INT,
            traffic_class: UNDEF_INT,
            comm_name: name,
            rest: [UNDEF_INT; 10],
        }
    }

    #[test]
    fn a_config_is_read_as_far_as_the_callers_header_had_it() {
        assert_eq!(std::mem::size_of::<Config>(), 96);
        // SAFETY: a whole config of the size it states.
        let read = |c: &Config| unsafe { settings((c as *const Config).cast()) };
        let name = c"trainer";
        let full = config(96, 23007, 0, name.as_ptr());
        assert_eq!(
            read(&full),
            Ok(Settings {
                blocking: false,
                name: Some("trainer".into())
            })
        );
        // A 2.18 header's config is 48 bytes and has no commName: whatever lies past it is not read.
        let old = config(48, 21803, 1, name.as_ptr());
        assert_eq!(read(&old), Ok(Settings::default()));
        // Left to the library: blocking.
        assert_eq!(
            read(&config(96, 23007, UNDEF_INT, std::ptr::null())),
            Ok(Settings::default())
        );
        assert!(read(&config(96, 23007, 2, std::ptr::null())).is_err());
        let mut bad = config(96, 23007, 1, std::ptr::null());
        bad.magic = 0;
        assert!(read(&bad).unwrap_err().contains("NCCL_CONFIG_INITIALIZER"));
        assert_eq!(
            // SAFETY: a null config is allowed.
            unsafe { settings(std::ptr::null()) },
            Ok(Settings::default())
        );
    }

    #[test]
    fn types_and_operators_map_or_name_what_is_missing() {
        assert_eq!(dtype(7), Ok(DType::F32));
        assert_eq!(dtype(9), Ok(DType::BF16));
        assert!(dtype(10).unwrap_err().contains("e4m3"));
        assert!(dtype(12).unwrap_err().contains("not an ncclDataType_t"));
        assert_eq!(reduce_op(4), Ok(ReduceOp::Avg));
        assert!(reduce_op(5).is_err());
        assert_eq!(std::mem::size_of::<UniqueId>(), UNIQUE_ID_BYTES);
        assert_eq!(NcclResult::from_raw(8), Some(NcclResult::Timeout));
        assert_eq!(NcclResult::from_raw(9), None);
    }
}
