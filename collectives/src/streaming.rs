//! Which calls write their outputs with streaming stores.
//!
//! A call's results land in the caller's output through the reduction kernels and, over
//! shared memory, the copies out of the slots. Written through the caches, every line of
//! the output is first read from memory, then written back to it: on buffers larger than
//! the caches that read is wasted, and streaming stores, which go straight to memory, save
//! it ([`reduce_into_streaming`](chorus_kernels::reduce_into_streaming)). On buffers the
//! caches hold, streaming loses: whatever reads the output next (the call's next step, the
//! caller) finds it in memory rather than in the caches. So a call streams when the buffers
//! of this host's ranks, inputs and outputs, fill half its last-level cache or more: what
//! else runs on the host, and the slots, have the other half. The cache is the largest of
//! the first processor's; where that one is per socket or per group of cores and ranks
//! spread over several, or other jobs share it, a size set in `CHORUS_STREAMING_STORES`
//! fits better.

use std::path::Path;

use crate::env::parse_size;

/// Which calls write their outputs with streaming stores (`CHORUS_STREAMING_STORES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Streaming {
    /// None.
    Never,
    /// Those whose buffers, over this host's ranks, fill half its last-level cache or more
    /// (the default; none where Linux does not tell the cache's size).
    #[default]
    HalfCache,
    /// Those whose buffers, over this host's ranks, span at least this many bytes.
    From(usize),
}

/// `0`: never; a size in bytes: calls whose buffers over the host span that many;
/// `cache`: the default.
impl std::str::FromStr for Streaming {
    type Err = String;

    fn from_str(s: &str) -> Result<Streaming, String> {
        match s.trim() {
            "cache" => Ok(Streaming::HalfCache),
            bytes => match bytes.parse() {
                Ok(0) => Ok(Streaming::Never),
                Ok(min) => Ok(Streaming::From(min)),
                Err(_) => Err("expected 0, a size in bytes, or cache".to_string()),
            },
        }
    }
}

impl Streaming {
    /// The bytes of one rank's buffers from which its calls stream, where `local` ranks
    /// share the host and its last-level cache holds `cache` bytes (`None`: unknown);
    /// `None`: never.
    pub(crate) fn per_rank(self, local: usize, cache: Option<usize>) -> Option<usize> {
        let host = match self {
            Streaming::Never => return None,
            Streaming::HalfCache => cache? / 2,
            Streaming::From(bytes) => bytes,
        };
        Some(host.div_ceil(local.max(1)).max(1))
    }
}

/// The size in bytes of the largest cache of this host's first processor (its last
/// level), as sysfs gives it; `None` where it does not.
pub(crate) fn last_level_cache() -> Option<usize> {
    let caches = Path::new("/sys/devices/system/cpu/cpu0/cache");
    std::fs::read_dir(caches)
        .ok()?
        .filter_map(|entry| {
            let size = std::fs::read_to_string(entry.ok()?.path().join("size")).ok()?;
            parse_size(&size).ok()
        })
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_sysfs_writes_them() {
        assert_eq!(parse_size("107520K\n"), Ok(107520 << 10));
        assert_eq!(parse_size("2M"), Ok(2 << 20));
        assert_eq!(parse_size("512"), Ok(512));
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn the_setting_parses_and_divides_among_the_hosts_ranks() {
        assert_eq!("cache".parse(), Ok(Streaming::HalfCache));
        assert_eq!("0".parse(), Ok(Streaming::Never));
        assert_eq!("000".parse(), Ok(Streaming::Never));
        assert_eq!(" 4096 ".parse(), Ok(Streaming::From(4096)));
        assert!("lots".parse::<Streaming>().is_err());
        let cache = Some(100 << 20);
        assert_eq!(Streaming::HalfCache.per_rank(2, cache), Some(25 << 20));
        assert_eq!(Streaming::HalfCache.per_rank(4, None), None);
        assert_eq!(Streaming::Never.per_rank(1, cache), None);
        assert_eq!(Streaming::From(10).per_rank(4, None), Some(3));
        assert_eq!(Streaming::From(10).per_rank(0, None), Some(10));
    }
}
