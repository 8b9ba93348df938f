//! The `file://` rendezvous: rank 0 writes its store's address into a file on a filesystem
//! every node sees, and the others poll it (see [`Master::File`](super::Master::File)).

use std::io::{self, Write};
use std::path::Path;
use std::time::{Duration, Instant};

/// First pause between two reads of a rendezvous file.
const FILE_FIRST_POLL: Duration = Duration::from_millis(10);
/// Longest pause between two reads of a rendezvous file.
const FILE_MAX_POLL: Duration = Duration::from_millis(250);
/// First word of a rendezvous file's content (names the format's version).
const FILE_MAGIC: &str = "chorus-rendezvous-v1";

/// Writes the file atomically: a temporary file beside it, then a rename.
pub(super) fn publish(path: &Path, run: &str, addr: &str, port: u16) -> io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let write = || -> io::Result<()> {
        let mut file = std::fs::File::create(&tmp)?;
        writeln!(file, "{FILE_MAGIC} run={run} addr={addr} port={port}")?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Parses a rendezvous file's content into (run, addr, port).
pub(super) fn parse_published(text: &str) -> Option<(String, String, u16)> {
    let mut words = text.split_whitespace();
    if words.next()? != FILE_MAGIC {
        return None;
    }
    let (mut run, mut addr, mut port) = (None, None, None);
    for word in words {
        match word.split_once('=')? {
            ("run", v) => run = Some(v.to_string()),
            ("addr", v) => addr = Some(v.to_string()),
            ("port", v) => port = v.parse().ok(),
            _ => {}
        }
    }
    Some((run?, addr?, port?))
}

/// Polls `path` until it holds an address for `run`, or `timeout` passes.
pub(super) fn wait_for_file(
    path: &Path,
    run: &str,
    timeout: Duration,
) -> Result<(String, u16), String> {
    let deadline = Instant::now() + timeout;
    let mut pause = FILE_FIRST_POLL;
    loop {
        let state = match std::fs::read_to_string(path) {
            Ok(text) => match parse_published(&text) {
                Some((r, addr, port)) if r == run => {
                    tracing::info!(path = %path.display(), %addr, port, "read the store address");
                    return Ok((addr, port));
                }
                Some((r, ..)) => format!("it holds an address for run {r:?}, not {run:?}"),
                None => format!("its content is not a Chorus rendezvous line: {text:?}"),
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => "it does not exist".to_string(),
            Err(e) => format!("it cannot be read: {e}"),
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(format!(
                "rank 0 did not publish its address in {} within {:?} ({state})",
                path.display(),
                timeout
            ));
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(FILE_MAX_POLL);
    }
}
