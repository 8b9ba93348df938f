//! Files written whole or not at all.

use std::io::Write;
use std::path::Path;

/// Replaces `path` with `bytes` atomically (temporary file, fsync, rename).
///
/// Fails naming the file on an I/O error.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let what = path.display();
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write {what}: {e}")
    })
}
