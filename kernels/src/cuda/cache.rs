//! The on-disk cache of compiled kernel images.
//!
//! One file per (source, target architecture, NVRTC version, options), named by a hash of
//! all four, under `$CHORUS_CUDA_CACHE`, else `$XDG_CACHE_HOME/chorus`, else
//! `~/.cache/chorus`. Each file carries a magic number, the image length and a checksum, so
//! a truncated or corrupted file is ignored (and rewritten) rather than loaded. Files are
//! written to a temporary name and renamed, so concurrent processes never see half a file.
//! Failing to read or write the cache only costs a compilation.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::env;

const MAGIC: &[u8; 8] = b"CHORUSK1";
const HEADER: usize = 24;

/// The cache folder from the environment, if any can be named.
pub(crate) fn dir() -> Option<PathBuf> {
    dir_from(
        std::env::var_os(env::CHORUS_CUDA_CACHE),
        std::env::var_os(env::XDG_CACHE_HOME),
        std::env::var_os(env::HOME),
    )
}

/// [`dir`] given the values of `CHORUS_CUDA_CACHE`, `XDG_CACHE_HOME` and `HOME` (empty
/// values count as unset).
pub(crate) fn dir_from(
    chorus: Option<OsString>,
    xdg: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    let set = |v: Option<OsString>| v.filter(|v| !v.is_empty()).map(PathBuf::from);
    set(chorus)
        .or_else(|| set(xdg).map(|x| x.join("chorus")))
        .or_else(|| set(home).map(|h| h.join(".cache").join("chorus")))
}

/// 64-bit FNV-1a, stable across Rust versions and platforms (unlike `DefaultHasher`).
pub(crate) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &byte in *part {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Separate the parts so that ("ab", "c") and ("a", "bc") differ.
        hash = (hash ^ 0xff).wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The cache file name for an image of `source` compiled for `target` by NVRTC
/// `nvrtc` (major, minor) with `options`.
pub(crate) fn file_name(
    source: &str,
    target: &str,
    nvrtc: (i32, i32),
    options: &[String],
) -> String {
    let version = format!("{}.{}", nvrtc.0, nvrtc.1);
    let options = options.join(" ");
    let key = fnv1a(&[
        source.as_bytes(),
        target.as_bytes(),
        version.as_bytes(),
        options.as_bytes(),
    ]);
    format!("kernels-{target}-{key:016x}.bin")
}

/// Reads a cached image; `None` if it is absent, unreadable or fails its checks.
pub(crate) fn read(path: &Path) -> Option<Vec<u8>> {
    let mut bytes = std::fs::read(path).ok()?;
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return None;
    }
    let len = u64::from_le_bytes(bytes[8..16].try_into().ok()?);
    let sum = u64::from_le_bytes(bytes[16..24].try_into().ok()?);
    let image = &bytes[HEADER..];
    if image.len() as u64 != len || fnv1a(&[image]) != sum {
        return None;
    }
    bytes.drain(..HEADER);
    Some(bytes)
}

/// Writes `image` to `path` atomically (temporary file, then rename), creating the folder.
pub(crate) fn write(path: &Path, image: &[u8]) -> io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let mut bytes = Vec::with_capacity(HEADER + image.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(image.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&fnv1a(&[image]).to_le_bytes());
    bytes.extend_from_slice(image);
    // A name of its own per write: threads of one process may write the same kernel at once.
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dir_prefers_chorus_then_xdg_then_home() {
        let s = |v: &str| Some(OsString::from(v));
        assert_eq!(
            dir_from(s("/c"), s("/x"), s("/h")),
            Some(PathBuf::from("/c"))
        );
        assert_eq!(
            dir_from(s(""), s("/x"), s("/h")),
            Some(PathBuf::from("/x/chorus"))
        );
        assert_eq!(
            dir_from(None, None, s("/h")),
            Some(PathBuf::from("/h/.cache/chorus"))
        );
        assert_eq!(dir_from(None, s(""), None), None);
    }

    #[test]
    fn file_name_depends_on_every_input() {
        let opts = vec!["--ftz=false".to_owned()];
        let base = file_name("src", "sm_90", (13, 0), &opts);
        assert!(
            base.starts_with("kernels-sm_90-") && base.ends_with(".bin"),
            "{base}"
        );
        assert_eq!(base, file_name("src", "sm_90", (13, 0), &opts));
        let others = [
            file_name("src2", "sm_90", (13, 0), &opts),
            file_name("src", "sm_80", (13, 0), &opts),
            file_name("src", "sm_90", (13, 1), &opts),
            file_name("src", "sm_90", (13, 0), &[]),
        ];
        for other in &others {
            assert_ne!(&base, other);
        }
        // The hash itself, not only the readable prefix, changes with the architecture.
        let hash = |name: &str| name.rsplit('-').next().unwrap_or_default().to_owned();
        assert_ne!(hash(&base), hash(&others[1]));
    }

    #[test]
    fn fnv1a_matches_reference_and_separates_parts() {
        // Reference value of 64-bit FNV-1a of "a" (before the part separator).
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        h = (h ^ u64::from(b'a')).wrapping_mul(0x0000_0100_0000_01b3);
        assert_eq!(h, 0xaf63_dc4c_8601_ec8c);
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }

    #[test]
    fn write_then_read_round_trips_and_rejects_corruption() {
        let dir = std::env::temp_dir().join(format!("chorus-cache-test-{}", std::process::id()));
        let path = dir.join("nested").join("image.bin");
        let image: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        write(&path, &image).unwrap();
        assert_eq!(read(&path).as_deref(), Some(&image[..]));

        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(read(&path), None, "corrupted image accepted");
        std::fs::write(&path, &bytes[..100]).unwrap();
        assert_eq!(read(&path), None, "truncated image accepted");
        std::fs::write(&path, b"garbage").unwrap();
        assert_eq!(read(&path), None, "garbage accepted");
        assert_eq!(read(&dir.join("missing.bin")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
