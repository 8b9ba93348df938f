//! The worker's side of torchrun's contract beyond the rendezvous variables: recording a
//! failure in torchrun's error file, so that torchrun's summary names it.
//!
//! A program that uses Chorus under torchrun (or under chorusrun, which sets no error file)
//! calls [`write_error_file`] with its error before it exits; the perf tools and `train` do.

use std::io;
use std::path::PathBuf;

use crate::env;

/// Records a worker's failure for torchrun: when `TORCHELASTIC_ERROR_FILE` names a file (torchrun
/// sets it), writes `message` there as torch's `@record` does, so torchrun's failure summary
/// shows it instead of "To enable traceback see ...". Returns the file written, or `None`
/// when the variable is unset.
///
/// The file is `{"message": {"message": M, "extraInfo": {"py_callstack": M, "timestamp": S}}}`
/// with S the seconds since 1970 as text; the summary prints `py_callstack` (here the message
/// again, as there is no Python stack) and picks the failure with the smallest timestamp as the
/// root cause. Fails if the file cannot be written.
pub fn write_error_file(message: &str) -> io::Result<Option<PathBuf>> {
    let Some(path) = std::env::var_os(env::TORCHELASTIC_ERROR_FILE).filter(|p| !p.is_empty())
    else {
        return Ok(None);
    };
    let path = PathBuf::from(path);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let json = error_file_json(message, now.map_or(0, |d| d.as_secs()));
    std::fs::write(&path, json)?;
    Ok(Some(path))
}

/// The error file's JSON for `message` at `timestamp` (seconds since 1970).
fn error_file_json(message: &str, timestamp: u64) -> String {
    let mut text = String::with_capacity(message.len() + 2);
    text.push('"');
    for c in message.chars() {
        match c {
            '"' => text.push_str("\\\""),
            '\\' => text.push_str("\\\\"),
            '\n' => text.push_str("\\n"),
            '\r' => text.push_str("\\r"),
            '\t' => text.push_str("\\t"),
            c if u32::from(c) < 0x20 => text.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => text.push(c),
        }
    }
    text.push('"');
    format!(
        r#"{{"message": {{"message": {text}, "extraInfo": {{"py_callstack": {text}, "timestamp": "{timestamp}"}}}}}}"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_files_hold_the_message_as_json() {
        let json = error_file_json("rank 1: \"x\" \\ \n\u{1} é", 1_700_000_000);
        let text = r#""rank 1: \"x\" \\ \n\u0001 é""#;
        let want = format!(
            r#"{{"message": {{"message": {text}, "extraInfo": {{"py_callstack": {text}, "timestamp": "1700000000"}}}}}}"#
        );
        assert_eq!(json, want);
    }
}
