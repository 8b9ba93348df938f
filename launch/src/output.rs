//! The workers' output: one reader thread per stream, capturing (bounded), forwarding line by
//! line with a rank prefix, and copying to log files.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};

use tracing::debug;

use crate::{Output, MAX_CAPTURED_BYTES};

/// Longest line forwarded in one piece; longer lines are split.
const MAX_LINE_BYTES: u64 = 64 << 10;

/// Which stream of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// Sent by a reader thread when its stream reaches end of file (with the local rank).
pub(crate) enum Event {
    Closed(usize),
}

/// A worker stream's captured text, bounded by a byte limit.
#[derive(Default)]
struct Captured {
    text: String,
    dropped: usize,
}

impl Captured {
    /// Appends `s`, dropping the oldest output (at a line start if possible) beyond `limit`.
    fn push(&mut self, s: &str, limit: usize) {
        self.text.push_str(s);
        if self.text.len() <= limit {
            return;
        }
        let keep = limit / 2;
        let mut cut = self.text.len() - keep;
        while !self.text.is_char_boundary(cut) {
            cut += 1;
        }
        if let Some(nl) = self.text[cut..].find('\n') {
            if nl < keep / 2 {
                cut += nl + 1;
            }
        }
        self.text.drain(..cut);
        self.dropped += cut;
    }

    /// The text, with a marker in front if output was dropped.
    fn into_text(self) -> String {
        if self.dropped == 0 {
            self.text
        } else {
            format!(
                "[chorus launch: {} earlier bytes dropped]\n{}",
                self.dropped, self.text
            )
        }
    }
}

fn lock(buf: &Mutex<Captured>) -> MutexGuard<'_, Captured> {
    buf.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A reader thread draining one worker stream.
pub(crate) struct Pump {
    buf: Arc<Mutex<Captured>>,
    handle: Option<JoinHandle<()>>,
    rank: usize,
    stream: Stream,
}

impl Pump {
    /// Starts the thread (none when the stream is missing) for the worker of global rank
    /// `rank` and local rank `local`; `tee` also gets every line, unprefixed.
    pub(crate) fn start(
        (rank, local): (usize, usize),
        stream: Stream,
        source: Option<impl Read + Send + 'static>,
        output: Output,
        tee: Option<File>,
        tx: Sender<Event>,
    ) -> io::Result<Pump> {
        let buf = Arc::new(Mutex::new(Captured::default()));
        let handle = match source {
            Some(source) => {
                let prefix = match output {
                    Output::Capture => None,
                    Output::Prefixed => Some(format!("[rank{rank}]: ")),
                    Output::RankZero if rank == 0 => Some(String::new()),
                    Output::RankZero => None,
                };
                let shared = Arc::clone(&buf);
                let name = format!("chorus-launch-r{rank}-{stream:?}").to_lowercase();
                Some(thread::Builder::new().name(name).spawn(move || {
                    pump(source, stream, prefix.as_deref(), tee, &shared);
                    let _ = tx.send(Event::Closed(local));
                })?)
            }
            None => {
                let _ = tx.send(Event::Closed(local));
                None
            }
        };
        Ok(Pump {
            buf,
            handle,
            rank,
            stream,
        })
    }

    /// The captured text; joins the thread if it is done, otherwise leaves it behind.
    pub(crate) fn finish(self) -> String {
        if let Some(handle) = self.handle {
            if handle.is_finished() {
                let _ = handle.join();
            } else {
                debug!(
                    rank = self.rank,
                    stream = ?self.stream,
                    "worker stream still open after the worker ended; output may be incomplete"
                );
            }
        }
        match Arc::try_unwrap(self.buf) {
            Ok(buf) => buf
                .into_inner()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .into_text(),
            Err(shared) => {
                let buf = lock(&shared);
                Captured {
                    text: buf.text.clone(),
                    dropped: buf.dropped,
                }
                .into_text()
            }
        }
    }
}

/// Reads `source` line by line until EOF, forwarding each line (when `prefix` is set), writing
/// it to `tee` (if any) and appending it to `buf`.
fn pump(
    source: impl Read,
    stream: Stream,
    prefix: Option<&str>,
    mut tee: Option<File>,
    buf: &Mutex<Captured>,
) {
    let mut reader = BufReader::new(source);
    let mut line = Vec::new();
    loop {
        line.clear();
        match (&mut reader)
            .take(MAX_LINE_BYTES)
            .read_until(b'\n', &mut line)
        {
            Ok(0) => break,
            Ok(_) => {
                if let Some(file) = &mut tee {
                    if let Err(e) = file.write_all(&line) {
                        debug!(error = %e, "cannot write the log file; no more lines go to it");
                        tee = None;
                    }
                }
                let text = String::from_utf8_lossy(&line);
                if let Some(prefix) = prefix {
                    forward(stream, prefix, &text);
                }
                lock(buf).push(&text, MAX_CAPTURED_BYTES);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
}

/// Writes one line to the launcher's stdout or stderr in a single write; errors are ignored
/// (the worker's output must keep draining even if the launcher's stdout is closed).
fn forward(stream: Stream, prefix: &str, text: &str) {
    let body = text.strip_suffix('\n').unwrap_or(text);
    let body = body.strip_suffix('\r').unwrap_or(body);
    let mut out = String::with_capacity(prefix.len() + body.len() + 1);
    out.push_str(prefix);
    out.push_str(body);
    out.push('\n');
    let _ = match stream {
        Stream::Stdout => io::stdout().lock().write_all(out.as_bytes()),
        Stream::Stderr => io::stderr().lock().write_all(out.as_bytes()),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captured_output_is_bounded() {
        let mut buf = Captured::default();
        for i in 0..100 {
            buf.push(&format!("line {i:04}\n"), 100);
        }
        assert!(buf.text.len() <= 100);
        assert!(buf.text.ends_with("line 0099\n"));
        assert!(buf.text.starts_with("line "));
        let text = buf.into_text();
        assert!(text.starts_with("[chorus launch: "), "{text}");
        assert!(text.ends_with("line 0099\n"));
    }
}
