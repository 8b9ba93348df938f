//! A client of the PMI-1 key-value space that MPICH's hydra (`mpiexec`, and Intel MPI's)
//! serves every rank it starts: rank 0 publishes where its store listens, the others read
//! it, so that `mpiexec -n 4 prog` needs no `MASTER_ADDR`.
//!
//! The connection is the socket hydra leaves open as `PMI_FD`, or, under `mpiexec -pmi-port`,
//! a TCP connection to `PMI_PORT` (`host:port`) introduced by `cmd=initack pmiid=$PMI_ID`,
//! whose answer (`cmd=initack`, then `cmd=set size=N`, `cmd=set rank=R`, `cmd=set debug=D`)
//! also gives the rank and size, which hydra then leaves out of the environment. Every
//! message is one line of space-separated words, `cmd=NAME` first and `key=value` after; an
//! answer carrying `rc` other than 0 is a failure, explained by its `msg`. The exchange:
//! `init` (version 1.1), `get_maxes` (the longest key and value), `get_my_kvsname`, rank 0's
//! `put` of `chorus-store=HOST:PORT` (or `chorus-store=failed`), `barrier_in` (answered by `barrier_out` once every rank
//! sent it), the others' `get`, and `finalize`: hydra stops the whole job when a process that
//! said `init` exits without `finalize`.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chorus_env as env;

/// How the client reads a variable: its value, or `None` when unset.
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The key rank 0's `host:port` is published under.
pub const STORE_KEY: &str = "chorus-store";
/// What rank 0 publishes instead when it cannot host its store.
const FAILED: &str = "failed";
/// Longest answer line read (hydra's values are at most 1024 bytes).
const MAX_LINE: u64 = 64 << 10;
/// Bound on the answers the server gives at once (every one but `barrier_out`).
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// One message: `cmd=NAME` and its attributes, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Message {
    pub cmd: String,
    pub attrs: Vec<(String, String)>,
}

impl Message {
    /// A message to send; fails when a word would not survive the wire (empty, or holding
    /// white space or `=`).
    pub(crate) fn new(cmd: &str, attrs: &[(&str, &str)]) -> Result<Message, String> {
        let word = |w: &str| -> Result<String, String> {
            if w.is_empty() || w.contains(|c: char| c.is_whitespace() || c == '=') {
                Err(format!(
                    "{w:?} cannot be sent over PMI (empty, or holds white space or '=')"
                ))
            } else {
                Ok(w.to_string())
            }
        };
        Ok(Message {
            cmd: word(cmd)?,
            attrs: attrs
                .iter()
                .map(|(k, v)| Ok((word(k)?, word(v)?)))
                .collect::<Result<_, String>>()?,
        })
    }

    /// The line on the wire, with its newline.
    pub(crate) fn line(&self) -> String {
        let mut line = format!("cmd={}", self.cmd);
        for (k, v) in &self.attrs {
            line.push_str(&format!(" {k}={v}"));
        }
        line.push('\n');
        line
    }

    /// Parses one line (without or with its newline).
    pub(crate) fn parse(line: &str) -> Result<Message, String> {
        let mut words = line.split_whitespace().map(|w| {
            w.split_once('=')
                .ok_or_else(|| format!("{w:?} is not key=value in {line:?}"))
        });
        let cmd = match words.next() {
            Some(Ok(("cmd", cmd))) if !cmd.is_empty() => cmd.to_string(),
            Some(Err(e)) => return Err(e),
            _ => return Err(format!("{line:?} does not start with cmd=NAME")),
        };
        let attrs = words
            .map(|kv| kv.map(|(k, v)| (k.to_string(), v.to_string())))
            .collect::<Result<_, _>>()?;
        Ok(Message { cmd, attrs })
    }

    /// The value of attribute `key`.
    pub(crate) fn attr(&self, key: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// A number attribute; fails naming the message when it is missing or malformed.
    fn number(&self, key: &str) -> Result<usize, String> {
        let v = self
            .attr(key)
            .ok_or_else(|| format!("no {key} in {:?}", self.line().trim_end()))?;
        v.parse().map_err(|_| {
            format!(
                "{key}={v:?} is not a number in {:?}",
                self.line().trim_end()
            )
        })
    }

    /// This message as the answer `cmd` to a request: fails when it is another one, or when
    /// its `rc` is not 0.
    pub(crate) fn expect(self, cmd: &str) -> Result<Message, String> {
        let text = || self.line().trim_end().to_string();
        if self.cmd != cmd {
            return Err(format!("expected cmd={cmd}, got {:?}", text()));
        }
        match self.attr("rc") {
            None | Some("0") => Ok(self),
            Some(rc) => Err(format!(
                "cmd={cmd} failed with rc={rc}: {}",
                self.attr("msg").unwrap_or("no message")
            )),
        }
    }
}

/// The socket to the PMI server.
#[derive(Debug)]
enum Link {
    /// Inherited from hydra (`PMI_FD`).
    Fd(UnixStream),
    /// Connected to `PMI_PORT`.
    Port(TcpStream),
}

impl Link {
    fn set_read_timeout(&self, timeout: Duration) -> io::Result<()> {
        let timeout = Some(timeout.max(Duration::from_millis(1)));
        match self {
            Link::Fd(s) => s.set_read_timeout(timeout),
            Link::Port(s) => s.set_read_timeout(timeout),
        }
    }
}

impl Read for Link {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Link::Fd(s) => s.read(buf),
            Link::Port(s) => s.read(buf),
        }
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Link::Fd(s) => s.write(buf),
            Link::Port(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Link::Fd(s) => s.flush(),
            Link::Port(s) => s.flush(),
        }
    }
}

/// An initialised PMI-1 session.
#[derive(Debug)]
pub(crate) struct Client {
    link: BufReader<Link>,
    kvsname: String,
    keylen_max: usize,
    vallen_max: usize,
    /// Rank and size from `PMI_PORT`'s `initack`.
    assigned: Option<(usize, usize)>,
}

impl Client {
    /// Sends `msg` and reads the answer `reply` within `timeout`.
    fn call(&mut self, msg: &Message, reply: &str, timeout: Duration) -> Result<Message, String> {
        send(&mut self.link, msg)?;
        receive(&mut self.link, timeout)?.expect(reply)
    }

    /// Starts the session: `init`, `get_maxes`, `get_my_kvsname`.
    fn start(link: Link, assigned: Option<(usize, usize)>) -> Result<Client, String> {
        let mut client = Client {
            link: BufReader::new(link),
            kvsname: String::new(),
            keylen_max: 0,
            vallen_max: 0,
            assigned,
        };
        let init = Message::new("init", &[("pmi_version", "1"), ("pmi_subversion", "1")])?;
        let answer = client.call(&init, "response_to_init", REPLY_TIMEOUT)?;
        if answer.attr("pmi_version") != Some("1") {
            return Err(format!(
                "the server speaks PMI version {:?}, not 1",
                answer.attr("pmi_version")
            ));
        }
        let maxes = client.call(&Message::new("get_maxes", &[])?, "maxes", REPLY_TIMEOUT)?;
        client.keylen_max = maxes.number("keylen_max")?;
        client.vallen_max = maxes.number("vallen_max")?;
        let name = client.call(
            &Message::new("get_my_kvsname", &[])?,
            "my_kvsname",
            REPLY_TIMEOUT,
        )?;
        client.kvsname = name
            .attr("kvsname")
            .ok_or("no kvsname in the answer to get_my_kvsname")?
            .to_string();
        Ok(client)
    }

    /// Stores `key=value` in the job's key-value space (seen by the others after a barrier).
    pub(crate) fn put(&mut self, key: &str, value: &str) -> Result<(), String> {
        if key.len() > self.keylen_max || value.len() > self.vallen_max {
            return Err(format!(
                "{key}={value} is longer than the server allows (keys {}, values {} bytes)",
                self.keylen_max, self.vallen_max
            ));
        }
        let kvs = self.kvsname.clone();
        let msg = Message::new("put", &[("kvsname", &kvs), ("key", key), ("value", value)])?;
        self.call(&msg, "put_result", REPLY_TIMEOUT).map(drop)
    }

    /// Waits until every rank of the job reached its barrier, at most `timeout`.
    pub(crate) fn barrier(&mut self, timeout: Duration) -> Result<(), String> {
        let msg = Message::new("barrier_in", &[])?;
        self.call(&msg, "barrier_out", timeout).map(drop)
    }

    /// The value of `key`; fails when no rank put it.
    pub(crate) fn get(&mut self, key: &str) -> Result<String, String> {
        let kvs = self.kvsname.clone();
        let msg = Message::new("get", &[("kvsname", &kvs), ("key", key)])?;
        let answer = self.call(&msg, "get_result", REPLY_TIMEOUT)?;
        answer
            .attr("value")
            .map(str::to_string)
            .ok_or_else(|| format!("no value for {key} in {:?}", answer.line().trim_end()))
    }

    /// Ends the session (hydra then lets this process exit without stopping the job).
    pub(crate) fn finalize(mut self) -> Result<(), String> {
        let msg = Message::new("finalize", &[])?;
        self.call(&msg, "finalize_ack", REPLY_TIMEOUT).map(drop)
    }
}

/// Writes one message.
fn send(link: &mut BufReader<Link>, msg: &Message) -> Result<(), String> {
    let line = msg.line();
    link.get_mut()
        .write_all(line.as_bytes())
        .map_err(|e| format!("cannot send {:?}: {e}", line.trim_end()))
}

/// Reads one message within `timeout`.
fn receive(link: &mut BufReader<Link>, timeout: Duration) -> Result<Message, String> {
    let deadline = Instant::now() + timeout;
    let mut line = String::new();
    while !line.ends_with('\n') {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no answer within {timeout:?}"));
        }
        link.get_ref()
            .set_read_timeout(left)
            .map_err(|e| format!("cannot set a timeout on the PMI socket: {e}"))?;
        let room = MAX_LINE.saturating_sub(line.len() as u64);
        match link.by_ref().take(room).read_line(&mut line) {
            Ok(0) if room == 0 => return Err(format!("an answer longer than {MAX_LINE} bytes")),
            Ok(0) => return Err("the PMI server closed the connection".to_string()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(format!("no answer within {timeout:?}"))
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("cannot read the answer: {e}")),
        }
    }
    Message::parse(&line)
}

/// The variable that names hydra's PMI server and its value: `PMI_FD`, else `PMI_PORT`.
pub fn server(get: Lookup<'_>) -> Option<(&'static str, String)> {
    [env::PMI_FD, env::PMI_PORT].into_iter().find_map(|var| {
        get(var)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .map(|v| (var, v))
    })
}

/// Opens and starts the session with the server that `server` names.
fn connect(get: Lookup<'_>) -> Result<Client, String> {
    match server(get) {
        Some((env::PMI_FD, fd)) => Client::start(Link::Fd(inherited_socket(&fd)?), None),
        Some((_, addr)) => {
            let id = get(env::PMI_ID).map(|v| v.trim().to_string());
            let id = id
                .filter(|v| !v.is_empty())
                .ok_or("PMI_PORT is set but PMI_ID is not")?;
            let (host, port) = addr
                .rsplit_once(':')
                .ok_or_else(|| format!("{addr:?} is not host:port"))?;
            let port: u16 = port.parse().map_err(|_| format!("bad port in {addr:?}"))?;
            let stream = TcpStream::connect((host, port))
                .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
            let mut link = BufReader::new(Link::Port(stream));
            send(&mut link, &Message::new("initack", &[("pmiid", &id)])?)?;
            receive(&mut link, REPLY_TIMEOUT)?.expect("initack")?;
            // `cmd=set` lines follow, one value each; `debug` comes last.
            let (mut rank, mut size) = (None, None);
            loop {
                let set = receive(&mut link, REPLY_TIMEOUT)?.expect("set")?;
                if set.attr("rank").is_some() {
                    rank = Some(set.number("rank")?);
                }
                if set.attr("size").is_some() {
                    size = Some(set.number("size")?);
                }
                if set.attr("debug").is_some() {
                    break;
                }
            }
            let assigned = rank
                .zip(size)
                .ok_or("the initack gave no rank or no size")?;
            Client::start(link.into_inner(), Some(assigned))
        }
        None => Err("neither PMI_FD nor PMI_PORT is set".to_string()),
    }
}

/// The socket hydra left open for this process as file descriptor `fd`.
fn inherited_socket(fd: &str) -> Result<UnixStream, String> {
    let raw: RawFd = fd
        .parse()
        .ok()
        .filter(|n| *n > 2)
        .ok_or_else(|| format!("{fd:?} is not a file descriptor number above 2"))?;
    let target = std::fs::read_link(format!("/proc/self/fd/{raw}"))
        .map_err(|e| format!("file descriptor {raw} is not open: {e}"))?;
    if !target.to_string_lossy().starts_with("socket:") {
        return Err(format!(
            "file descriptor {raw} is {}, not a socket",
            target.display()
        ));
    }
    // SAFETY: the descriptor is open and a socket (checked above), hydra made it for this
    // process alone, and `SESSION` makes sure it is taken at most once, so nothing else owns
    // it or closes it.
    let owned = unsafe { OwnedFd::from_raw_fd(raw) };
    Ok(UnixStream::from(owned))
}

/// The session of this process: hydra serves one per process, so it is opened once, and a
/// later rendezvous (another `Config::from_env`) reuses its outcome.
static SESSION: Mutex<Session> = Mutex::new(Session::Unused);

#[derive(Debug)]
enum Session {
    Unused,
    /// Opened to learn the rank (`PMI_PORT`), not yet used for the rendezvous.
    Open(Client),
    /// Rendezvous done: rank 0's `host:port`, or why not.
    Done(Result<String, String>),
}

/// The rank and size hydra gives under `-pmi-port` (in the `initack`, not the environment);
/// `None` when it serves PMI some other way. Opens the session, kept for [`rendezvous`].
pub fn assigned_ranks(get: Lookup<'_>) -> Result<Option<(usize, usize)>, String> {
    if server(get).map(|(var, _)| var) != Some(env::PMI_PORT) {
        return Ok(None);
    }
    let mut session = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    match &*session {
        Session::Unused => {
            let client = connect(get)?;
            let assigned = client.assigned;
            *session = Session::Open(client);
            Ok(assigned)
        }
        Session::Open(client) => Ok(client.assigned),
        Session::Done(_) => Err(
            "this process already ended its PMI session: export RANK and WORLD_SIZE, or \
             MASTER_ADDR and MASTER_PORT, for a second rendezvous"
                .to_string(),
        ),
    }
}

/// Rank 0 publishes `publish()` (its `host:port`), every rank meets in a barrier (at most
/// `timeout`), and the others read it; returns rank 0's `host:port`.
///
/// Once per process: a second call returns the first one's outcome without calling
/// `publish`. Fails when `publish` fails (rank 0 then publishes that it failed, and the
/// others fail saying so), the server is not there or misbehaves, or the barrier times out.
pub fn rendezvous(
    get: Lookup<'_>,
    rank: usize,
    timeout: Duration,
    publish: impl FnOnce() -> Result<String, String>,
) -> Result<String, String> {
    let mut session = SESSION.lock().unwrap_or_else(|p| p.into_inner());
    let open = match std::mem::replace(&mut *session, Session::Unused) {
        Session::Done(outcome) => {
            *session = Session::Done(outcome.clone());
            return outcome;
        }
        Session::Open(client) => Some(client),
        Session::Unused => None,
    };
    let outcome = exchange(open, get, rank, timeout, publish);
    *session = Session::Done(outcome.clone());
    outcome
}

/// [`rendezvous`]'s exchange, on the session `open` if there is one.
fn exchange(
    open: Option<Client>,
    get: Lookup<'_>,
    rank: usize,
    timeout: Duration,
    publish: impl FnOnce() -> Result<String, String>,
) -> Result<String, String> {
    let mut client = match open {
        Some(client) => client,
        None => connect(get)?,
    };
    let outcome = meet(&mut client, rank, timeout, publish);
    // The session is ended on failure too: hydra treats a process that exits inside one as
    // crashed and stops the job at once, before it has passed on the process's last output.
    let ended = client.finalize();
    let outcome = outcome?;
    ended?;
    outcome
}

/// [`exchange`]'s puts, barrier and gets on an open session: `Err` when the session failed,
/// `Ok(Err)` when rank 0 could not host the store.
fn meet(
    client: &mut Client,
    rank: usize,
    timeout: Duration,
    publish: impl FnOnce() -> Result<String, String>,
) -> Result<Result<String, String>, String> {
    if rank == 0 {
        // A failure is published too, so that the others stop at once (hydra does not stop a
        // job whose process exits with an error outside a PMI session) and every rank ends its
        // session, leaving hydra to report the exits as usual.
        let published = publish();
        client.put(STORE_KEY, published.as_deref().unwrap_or(FAILED))?;
        client.barrier(timeout)?;
        Ok(published)
    } else {
        client.barrier(timeout).map_err(|e| {
            format!(
                "waiting for rank 0 to publish its address: {e} (a rank that exits before its \
                 rendezvous, rank 0 included, does not stop a hydra job: see its output)"
            )
        })?;
        Ok(match client.get(STORE_KEY)? {
            addr if addr == FAILED => Err(
                "rank 0 could not host the rendezvous store (its own error says why)".to_string(),
            ),
            addr => Ok(addr),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let msg = Message::new(
            "put",
            &[("kvsname", "kvs_1_0"), ("key", "k"), ("value", "h:1")],
        )
        .unwrap();
        assert_eq!(msg.line(), "cmd=put kvsname=kvs_1_0 key=k value=h:1\n");
        assert_eq!(Message::parse(&msg.line()).unwrap(), msg);
        let maxes =
            Message::parse("cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024\n").unwrap();
        assert_eq!(maxes.cmd, "maxes");
        assert_eq!(maxes.attr("keylen_max"), Some("64"));
        assert_eq!(maxes.number("vallen_max"), Ok(1024));
        assert_eq!(maxes.attr("absent"), None);
        // Values may be empty on the wire; words hold no '=' beyond the first.
        let reply = Message::parse("cmd=get_result rc=0 msg=success value=").unwrap();
        assert_eq!(reply.expect("get_result").unwrap().attr("value"), Some(""));
        assert_eq!(
            Message::parse("cmd=x a=b=c").unwrap().attr("a"),
            Some("b=c")
        );
    }

    #[test]
    fn bad_messages_are_named() {
        for (line, needle) in [
            ("", "does not start with cmd=NAME"),
            ("rc=0 cmd=x", "does not start with cmd=NAME"),
            ("cmd= a=b", "does not start with cmd=NAME"),
            ("cmd=x novalue", "\"novalue\" is not key=value"),
            ("garbage", "\"garbage\" is not key=value"),
        ] {
            let err = Message::parse(line).unwrap_err();
            assert!(err.contains(needle), "{line:?}: {err:?} lacks {needle:?}");
        }
        for word in ["", "a b", "a=b", "tab\there", "nl\n"] {
            let err = Message::new("put", &[("value", word)]).unwrap_err();
            assert!(err.contains("cannot be sent over PMI"), "{err}");
        }
        let maxes = Message::parse("cmd=maxes keylen_max=x").unwrap();
        assert!(maxes
            .number("keylen_max")
            .unwrap_err()
            .contains("not a number"));
        assert!(maxes
            .number("vallen_max")
            .unwrap_err()
            .contains("no vallen_max"));
    }

    #[test]
    fn answers_are_checked() {
        let ok = Message::parse("cmd=put_result rc=0 msg=success").unwrap();
        assert!(ok.clone().expect("put_result").is_ok());
        assert_eq!(
            ok.expect("barrier_out").unwrap_err(),
            "expected cmd=barrier_out, got \"cmd=put_result rc=0 msg=success\""
        );
        let missing =
            Message::parse("cmd=get_result rc=-1 msg=key_missing_not_found value=unknown").unwrap();
        assert_eq!(
            missing.expect("get_result").unwrap_err(),
            "cmd=get_result failed with rc=-1: key_missing_not_found"
        );
        assert!(Message::parse("cmd=barrier_out")
            .unwrap()
            .expect("barrier_out")
            .is_ok());
    }

    /// Runs `script` as a PMI server on one end of a socket pair: for each expected request,
    /// the answer lines to write. The server's end stays open until it is joined.
    fn serve(
        script: Vec<(&'static str, Vec<&'static str>)>,
    ) -> (Link, std::thread::JoinHandle<UnixStream>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            let mut reader = BufReader::new(theirs.try_clone().unwrap());
            let mut theirs = theirs;
            for (want, answers) in script {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                assert_eq!(line.trim_end(), want);
                for answer in answers {
                    writeln!(theirs, "{answer}").unwrap();
                }
            }
            theirs
        });
        (Link::Fd(ours), server)
    }

    const START: [(&str, &str); 3] = [
        (
            "cmd=init pmi_version=1 pmi_subversion=1",
            "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0",
        ),
        (
            "cmd=get_maxes",
            "cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=16",
        ),
        ("cmd=get_my_kvsname", "cmd=my_kvsname kvsname=kvs_7_0"),
    ];

    #[test]
    fn a_session_as_rank_0_and_as_another() {
        let mut script: Vec<_> = START.iter().map(|(q, a)| (*q, vec![*a])).collect();
        script.extend([
            (
                "cmd=put kvsname=kvs_7_0 key=chorus-store value=10.0.0.1:5",
                vec!["cmd=put_result rc=0 msg=success"],
            ),
            ("cmd=barrier_in", vec!["cmd=barrier_out"]),
            (
                "cmd=get kvsname=kvs_7_0 key=chorus-store",
                vec!["cmd=get_result rc=0 msg=success value=10.0.0.1:5"],
            ),
            ("cmd=finalize", vec!["cmd=finalize_ack"]),
        ]);
        let (link, server) = serve(script);
        let mut client = Client::start(link, None).unwrap();
        assert_eq!(client.kvsname, "kvs_7_0");
        client.put(STORE_KEY, "10.0.0.1:5").unwrap();
        // Longer than vallen_max: refused before anything is sent.
        let err = client.put(STORE_KEY, "a-very-long-host:12345").unwrap_err();
        assert!(err.contains("longer than the server allows"), "{err}");
        client.barrier(Duration::from_secs(5)).unwrap();
        assert_eq!(client.get(STORE_KEY).unwrap(), "10.0.0.1:5");
        client.finalize().unwrap();
        server.join().unwrap();
    }

    #[test]
    fn rank_0_publishes_its_failure_and_the_others_fail_at_once() {
        let session = |put_or_get: (&'static str, &'static str)| {
            let mut script: Vec<_> = START.iter().map(|(q, a)| (*q, vec![*a])).collect();
            script.extend([
                (put_or_get.0, vec![put_or_get.1]),
                ("cmd=barrier_in", vec!["cmd=barrier_out"]),
                ("cmd=finalize", vec!["cmd=finalize_ack"]),
            ]);
            if put_or_get.0.starts_with("cmd=get") {
                script.swap(3, 4);
            }
            let (link, server) = serve(script);
            (Client::start(link, None).unwrap(), server)
        };
        let none = |_: &str| None;
        let (client, server) = session((
            "cmd=put kvsname=kvs_7_0 key=chorus-store value=failed",
            "cmd=put_result rc=0",
        ));
        let err = exchange(Some(client), &none, 0, Duration::from_secs(5), || {
            Err("port busy".to_string())
        });
        assert_eq!(err, Err("port busy".to_string()));
        server.join().unwrap();
        let (client, server) = session((
            "cmd=get kvsname=kvs_7_0 key=chorus-store",
            "cmd=get_result rc=0 value=failed",
        ));
        let err = exchange(Some(client), &none, 1, Duration::from_secs(5), || {
            unreachable!("only rank 0 publishes")
        });
        assert!(err.unwrap_err().contains("rank 0 could not host"));
        server.join().unwrap();
    }

    #[test]
    fn a_silent_or_closing_server_is_an_error_not_a_hang() {
        let mut script: Vec<_> = START.iter().map(|(q, a)| (*q, vec![*a])).collect();
        script.push(("cmd=barrier_in", vec![]));
        let (link, server) = serve(script);
        let mut client = Client::start(link, None).unwrap();
        let err = client.barrier(Duration::from_millis(200)).unwrap_err();
        assert_eq!(err, "no answer within 200ms");
        drop(server.join().unwrap());
        // The server's end is gone now.
        let err = client.get(STORE_KEY).unwrap_err();
        assert!(
            err.contains("closed the connection") || err.contains("cannot send"),
            "{err}"
        );

        let (link, server) = serve(vec![(
            START[0].0,
            vec!["cmd=response_to_init pmi_version=2 rc=0"],
        )]);
        let err = Client::start(link, None).unwrap_err();
        assert!(err.contains("PMI version Some(\"2\"), not 1"), "{err}");
        server.join().unwrap();
    }

    #[test]
    fn pmi_port_introduces_itself_and_learns_its_rank() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut stream = stream;
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            assert_eq!(line, "cmd=initack pmiid=3\n");
            stream
                .write_all(b"cmd=initack\ncmd=set size=4\ncmd=set rank=3\ncmd=set debug=0\n")
                .unwrap();
            for (want, answer) in START {
                line.clear();
                reader.read_line(&mut line).unwrap();
                assert_eq!(line.trim_end(), want);
                writeln!(stream, "{answer}").unwrap();
            }
        });
        let vars = [
            ("PMI_PORT", format!("localhost:{port}")),
            ("PMI_ID", "3".to_string()),
        ];
        let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(server_var(&get), Some(env::PMI_PORT));
        let client = connect(&get).unwrap();
        assert_eq!(client.assigned, Some((3, 4)));
        assert_eq!(client.kvsname, "kvs_7_0");
        server.join().unwrap();

        let no_id = |k: &str| (k == "PMI_PORT").then(|| "h:1".to_string());
        assert_eq!(
            connect(&no_id).unwrap_err(),
            "PMI_PORT is set but PMI_ID is not"
        );
        let bad = |k: &str| match k {
            "PMI_PORT" => Some("nohostport".to_string()),
            "PMI_ID" => Some("0".to_string()),
            _ => None,
        };
        assert!(connect(&bad).unwrap_err().contains("is not host:port"));
        assert_eq!(server_var(&|_: &str| None), None);
    }

    fn server_var(get: Lookup<'_>) -> Option<&'static str> {
        server(get).map(|(var, _)| var)
    }

    #[test]
    fn inherited_descriptors_are_checked() {
        for (fd, needle) in [
            ("x", "not a file descriptor number above 2"),
            ("1", "not a file descriptor number above 2"),
            ("999999", "is not open"),
        ] {
            let err = inherited_socket(fd).unwrap_err();
            assert!(err.contains(needle), "{fd}: {err}");
        }
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let raw = std::os::fd::AsRawFd::as_raw_fd(&file).to_string();
        assert!(inherited_socket(&raw).unwrap_err().contains("not a socket"));
    }
}
