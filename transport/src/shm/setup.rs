//! Setting up the shared region: the lowest local rank creates a file in the
//! shared-memory directory and publishes its name; every local rank maps it,
//! publishes its process id, and says so; the creator unlinks the file as
//! soon as all have mapped it, so a crash later leaves nothing behind. A
//! creator killed before that leaves its file; the next creator on the host
//! removes it.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use memmap2::MmapRaw;

use super::cma;
use super::cores::Cores;
use super::region::{Layout, Region};
use super::{ShmConfig, SingleCopy};
use crate::store::Store;
use crate::TransportError;

/// The region of a local group, and about its ranks (by local rank): their
/// process ids, and whether each can read its peers' memory (single copy); and
/// the cores they share (the same count on every one of them).
pub(crate) struct Joined {
    pub region: Region,
    pub pids: Vec<u32>,
    pub reads_peers: Vec<bool>,
    pub cores: usize,
}

/// Creates or opens the region shared by the ranks `local` (global ranks,
/// ascending), of which `rank` is one.
pub(crate) fn join(
    rank: usize,
    local: &[usize],
    store: &dyn Store,
    config: &ShmConfig,
) -> Result<Joined, TransportError> {
    let leader = local[0];
    let layout = Layout {
        locals: local.len(),
        slots: config.slots,
        slot_bytes: config.slot_bytes.div_ceil(64) * 64,
    };
    let key = |what: &str, r: usize| format!("shm/{leader}/{what}/{r}");
    let (region, created) = if rank == leader {
        let (path, file) = create(&config.dir, layout.total_bytes())?;
        // Unlinked on every path out of this function: after the others have
        // mapped it, or at once if set-up fails.
        let created = Unlink(path.clone());
        let region = Region::init(map(&file, &path)?, layout);
        let name = path.to_string_lossy().into_owned();
        store.set(&format!("shm/{leader}/path"), name.as_bytes())?;
        (region, Some(created))
    } else {
        let raw = store.get(&format!("shm/{leader}/path"))?;
        let path = PathBuf::from(String::from_utf8_lossy(&raw).into_owned());
        let file = open(&path, rank, leader)?;
        let region = Region::open(map(&file, &path)?, layout)
            .map_err(|e| TransportError::Setup(format!("{}: {e}", path.display())))?;
        (region, None)
    };
    let me = format!(
        "{} {} {}",
        std::process::id(),
        cma::probe_address(),
        Cores::of_this_process()
    );
    store.set(&key("pid", rank), me.as_bytes())?;
    let mut pids = Vec::with_capacity(local.len());
    let mut cores = Vec::with_capacity(local.len());
    let mut readable = true;
    for &r in local {
        let raw = store.get(&key("pid", r))?;
        let text = String::from_utf8_lossy(&raw);
        let bad = || TransportError::Setup(format!("rank {r} published a bad process id: {text}"));
        let mut words = text.split(' ');
        let mut next = || words.next().ok_or_else(bad);
        let pid: u32 = next()?.parse().map_err(|_| bad())?;
        let probe: u64 = next()?.parse().map_err(|_| bad())?;
        cores.push(next()?.parse::<Cores>().map_err(|_| bad())?);
        readable &=
            config.single_copy != SingleCopy::Never && (r == rank || cma::can_read(pid, probe));
        pids.push(pid);
    }
    store.set(&key("cma", rank), if readable { b"1" } else { b"0" })?;
    let mut reads_peers = Vec::with_capacity(local.len());
    for &r in local {
        reads_peers.push(store.get(&key("cma", r))? == b"1");
    }
    if let Some(created) = created {
        let keys: Vec<String> = local.iter().map(|&r| key("pid", r)).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        store.wait(&keys, config.timeout)?;
        drop(created);
    }
    Ok(Joined {
        region,
        pids,
        reads_peers,
        cores: Cores::shared(&cores),
    })
}

/// Removes the file at its path when dropped.
pub(crate) struct Unlink(pub PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.0) {
            tracing::warn!(path = %self.0.display(), "cannot unlink the shared-memory file: {e}");
        }
    }
}

/// Creates a fresh file of `size` bytes named for this process in `dir`, first removing
/// the files there whose creators died before unlinking them.
pub(crate) fn create(dir: &Path, size: usize) -> Result<(PathBuf, File), TransportError> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_nanos();
    let ns = pid_namespace();
    if let Some(ns) = &ns {
        remove_stale(dir, ns);
    }
    let ns = ns.as_deref().unwrap_or("unknown");
    let path = dir.join(format!("chorus-{}-{nanos:x}-{ns}", std::process::id()));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| {
            TransportError::resource(
                format!(
                    "cannot create the shared-memory file {} (set CHORUS_TRANSPORT=tcp where \
                     there is no {})",
                    path.display(),
                    dir.display()
                ),
                e,
            )
        })?;
    // Allocate every page now: a full tmpfs then fails here, not with SIGBUS later.
    // SAFETY: a valid open fd; offset and length are plain integers.
    let err = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size as libc::off_t) };
    if err != 0 {
        let _ = std::fs::remove_file(&path);
        return Err(TransportError::resource(
            format!(
                "cannot allocate {size} bytes for the shared-memory file {} (is {} full? set \
                 CHORUS_TRANSPORT=tcp to avoid it)",
                path.display(),
                dir.display()
            ),
            std::io::Error::from_raw_os_error(err),
        ));
    }
    Ok((path, file))
}

/// This process's pid namespace (the inode number of `/proc/self/ns/pid`): a file's
/// creator is looked up by pid only where the file was made in this namespace.
fn pid_namespace() -> Option<String> {
    let link = std::fs::read_link("/proc/self/ns/pid").ok()?;
    let link = link.to_str()?;
    let inode = link.strip_prefix("pid:[")?.strip_suffix(']')?;
    Some(inode.to_string())
}

/// The creator's pid of a file named `chorus-PID-HEX-NS` made in pid namespace `ns`.
fn creator(name: &str, ns: &str) -> Option<libc::pid_t> {
    let mut parts = name.strip_prefix("chorus-")?.split('-');
    let pid = parts
        .next()?
        .parse()
        .ok()
        .filter(|&pid: &libc::pid_t| pid > 0)?;
    let _nanos = parts.next()?;
    (parts.next()? == ns && parts.next().is_none()).then_some(pid)
}

/// Removes the files in `dir` whose creators, in pid namespace `ns`, no longer run (killed
/// during set-up, before they unlinked them). Files of live creators, of other namespaces
/// and of other users stay.
fn remove_stale(dir: &Path, ns: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| creator(n, ns)) else {
            continue;
        };
        // SAFETY: signal 0 sends nothing; it only asks whether `pid` exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => tracing::info!(
                    path = %entry.path().display(),
                    "removed the shared-memory file of a process that died during set-up"
                ),
                Err(e) => tracing::debug!(
                    path = %entry.path().display(),
                    "cannot remove a dead process's shared-memory file: {e}"
                ),
            }
        }
    }
}

/// Opens the file `leader` created, for `rank`.
pub(crate) fn open(path: &Path, rank: usize, leader: usize) -> Result<File, TransportError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| {
            TransportError::resource(
                format!(
                    "rank {rank} cannot open the shared-memory file {} of rank {leader} (do the \
                     ranks share /dev/shm? set CHORUS_HOST_ID per host, or CHORUS_TRANSPORT=tcp)",
                    path.display()
                ),
                e,
            )
        })
}

pub(crate) fn map(file: &File, path: &Path) -> Result<MmapRaw, TransportError> {
    MmapRaw::map_raw(file)
        .map_err(|e| TransportError::resource(format!("cannot map {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{StoreServer, TcpStore};

    /// What two local ranks (threads here) learn about single copies at set-up.
    fn reads_peers(single_copy: bool) -> Vec<Vec<bool>> {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = server.local_addr().port();
        let config = ShmConfig {
            single_copy: match single_copy {
                true => SingleCopy::From(64 << 10),
                false => SingleCopy::Never,
            },
            timeout: Duration::from_secs(20),
            ..ShmConfig::default()
        };
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let config = config.clone();
                std::thread::spawn(move || {
                    let store =
                        TcpStore::connect("127.0.0.1", port, Duration::from_secs(20)).unwrap();
                    join(rank, &[0, 1], &store, &config).unwrap().reads_peers
                })
            })
            .collect();
        ranks.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn files_of_dead_creators_are_removed_by_the_next() {
        let dir = std::env::temp_dir().join(format!("chorus-stale-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ns = pid_namespace().expect("a pid namespace");
        let mut ended = std::process::Command::new("true").spawn().unwrap();
        let dead = ended.id();
        ended.wait().unwrap();
        let me = std::process::id();
        let stale = format!("chorus-{dead}-1-{ns}");
        let kept = [
            format!("chorus-{me}-2-{ns}"),
            format!("chorus-{dead}-3-1{ns}"),
            format!("chorus-{dead}-4"),
            "other-file".to_string(),
        ];
        for name in kept.iter().chain([&stale]) {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        let (path, _file) = create(&dir, 4096).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().into_string().unwrap())
            .collect();
        left.sort();
        let mut want: Vec<String> = kept.to_vec();
        want.push(path.file_name().unwrap().to_str().unwrap().to_string());
        want.sort();
        assert_eq!(left, want);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn single_copies_are_offered_only_when_configured() {
        assert_eq!(reads_peers(true), vec![vec![true, true]; 2]);
        assert_eq!(reads_peers(false), vec![vec![false, false]; 2]);
    }
}
