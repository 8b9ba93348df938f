//! The unique id: where the job's rendezvous store listens and the secret its ranks prove.
//!
//! `ncclGetUniqueId` starts a Chorus store in the calling process (as NCCL's bootstrap root
//! serves from the process that made the id) and writes into the id's 128 bytes:
//!
//! | bytes | what |
//! |---|---|
//! | 0..4 | `CHRS`, then the layout's version (1) and the address family (4 or 6) |
//! | 6..8 | the store's port, big-endian |
//! | 8..24 | its address (IPv4 in the first 4 bytes) |
//! | 24..40 | the job's secret, which every connection proves |
//! | 40..56 | the job's name, which tells its communicators apart in the store |
//!
//! The store stays in this process (it is the rendezvous of the communicators made from the
//! id, for their whole life); the first rank of this process that joins with the id keeps it.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Mutex;

use chorus::{Auth, StoreServer};

use crate::abi::{UniqueId, UNIQUE_ID_BYTES};
use crate::lock;

const MAGIC: &[u8; 4] = b"CHRS";
const LAYOUT: u8 = 1;

/// A decoded unique id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rendezvous {
    /// The store's address.
    pub addr: SocketAddr,
    /// The job's secret.
    pub secret: [u8; 16],
    /// The job's name.
    pub job: [u8; 16],
}

/// Stores this process serves, by job name, until a rank of this process takes its own;
/// with the id of the process that started each (a child forked since holds a copy of the
/// map, but not the store's threads: it joins as a client, as every other process does).
static HOSTED: Mutex<Option<Hosted>> = Mutex::new(None);

/// Each job's store, with the id of the process that started it.
type Hosted = HashMap<[u8; 16], (u32, StoreServer)>;

impl Rendezvous {
    /// Starts a store for a new job and describes it: on `NCCL_COMM_ID`'s `host:port` where
    /// set, else on a free port of this host's address (see [`host_addr`]).
    pub fn serve() -> Result<Rendezvous, String> {
        let secret = random()?;
        let job = random()?;
        let fixed = std::env::var(chorus_env::NCCL_COMM_ID).ok();
        let addr = match &fixed {
            Some(spec) => parse_comm_id(spec)?,
            None => SocketAddr::new(host_addr(), 0),
        };
        let me = Rendezvous { addr, secret, job };
        let bind = SocketAddr::new(
            match addr {
                SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            },
            addr.port(),
        );
        let server = StoreServer::bind_with_auth(bind, me.auth()?)
            .map_err(|e| format!("cannot start the rendezvous store on {bind}: {e}"))?;
        let me = Rendezvous {
            addr: SocketAddr::new(addr.ip(), server.local_addr().port()),
            ..me
        };
        lock(&HOSTED)
            .get_or_insert_with(HashMap::new)
            .insert(job, (std::process::id(), server));
        Ok(me)
    }

    /// The store this process serves for this job, the first time a rank here asks.
    pub fn take_server(&self) -> Option<StoreServer> {
        let mut hosted = lock(&HOSTED);
        let hosted = hosted.as_mut()?;
        match hosted.get(&self.job) {
            Some((pid, _)) if *pid == std::process::id() => {
                hosted.remove(&self.job).map(|(_, s)| s)
            }
            _ => None,
        }
    }

    /// What every connection of the job proves.
    pub fn auth(&self) -> Result<Auth, String> {
        Auth::new(hex(&self.job), hex(&self.secret)).map_err(|e| e.to_string())
    }

    /// The job's name, as text.
    pub fn job_name(&self) -> String {
        hex(&self.job)
    }

    /// The id's bytes.
    pub fn encode(&self) -> UniqueId {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        bytes[..4].copy_from_slice(MAGIC);
        bytes[4] = LAYOUT;
        bytes[6..8].copy_from_slice(&self.addr.port().to_be_bytes());
        match self.addr.ip() {
            IpAddr::V4(ip) => {
                bytes[5] = 4;
                bytes[8..12].copy_from_slice(&ip.octets());
            }
            IpAddr::V6(ip) => {
                bytes[5] = 6;
                bytes[8..24].copy_from_slice(&ip.octets());
            }
        }
        bytes[24..40].copy_from_slice(&self.secret);
        bytes[40..56].copy_from_slice(&self.job);
        UniqueId {
            internal: bytes.map(|b| b as std::ffi::c_char),
        }
    }

    /// The job an id describes; fails on bytes `ncclGetUniqueId` did not write.
    pub fn decode(id: &UniqueId) -> Result<Rendezvous, String> {
        let bytes = id.internal.map(|c| c as u8);
        if &bytes[..4] != MAGIC || bytes[4] != LAYOUT {
            return Err(
                "the ncclUniqueId was not made by this library's ncclGetUniqueId \
                 (every rank must load the same libnccl)"
                    .into(),
            );
        }
        let port = u16::from_be_bytes([bytes[6], bytes[7]]);
        let ip = match bytes[5] {
            4 => IpAddr::V4(Ipv4Addr::new(bytes[8], bytes[9], bytes[10], bytes[11])),
            6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&bytes[8..24]).unwrap())),
            f => return Err(format!("the ncclUniqueId names address family {f}")),
        };
        let take = |at: usize| <[u8; 16]>::try_from(&bytes[at..at + 16]).unwrap();
        Ok(Rendezvous {
            addr: SocketAddr::new(ip, port),
            secret: take(24),
            job: take(40),
        })
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn random() -> Result<[u8; 16], String> {
    let nonce = chorus_transport::auth::nonce().map_err(|e| e.to_string())?;
    let mut out = [0u8; 16];
    out.copy_from_slice(&nonce[..16]);
    Ok(out)
}

/// `NCCL_COMM_ID`'s `host:port` (a name, an IPv4 address, or `[v6]:port`).
fn parse_comm_id(spec: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    spec.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| format!("NCCL_COMM_ID={spec:?} is not host:port"))
}

/// The address other hosts reach this one at: the first interface that is up, not loopback
/// and has an IPv4 address (of those `NCCL_SOCKET_IFNAME` allows: comma-separated name
/// prefixes, `^` to exclude them, `=` for exact names), else loopback.
pub fn host_addr() -> IpAddr {
    let filter = std::env::var(chorus_env::NCCL_SOCKET_IFNAME).unwrap_or_default();
    let mut found = None;
    // SAFETY: getifaddrs fills a list that freeifaddrs releases; each entry is read while
    // the list is alive.
    unsafe {
        let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut list) != 0 {
            return IpAddr::V4(Ipv4Addr::LOCALHOST);
        }
        let mut at = list;
        while let Some(ifa) = at.as_ref() {
            at = ifa.ifa_next;
            let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
            let loopback = ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
            if !up || loopback || ifa.ifa_addr.is_null() {
                continue;
            }
            if i32::from((*ifa.ifa_addr).sa_family) != libc::AF_INET {
                continue;
            }
            let name = std::ffi::CStr::from_ptr(ifa.ifa_name).to_string_lossy();
            if !allowed(&filter, &name) {
                continue;
            }
            let sin = &*ifa.ifa_addr.cast::<libc::sockaddr_in>();
            found = Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                sin.sin_addr.s_addr,
            ))));
            break;
        }
        libc::freeifaddrs(list);
    }
    found.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// Whether `NCCL_SOCKET_IFNAME`'s `filter` allows interface `name`.
fn allowed(filter: &str, name: &str) -> bool {
    let (exclude, list) = match filter.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, filter),
    };
    if list.is_empty() {
        return true;
    }
    let hit = list.split(',').any(|p| match p.strip_prefix('=') {
        Some(exact) => name == exact,
        None => name.starts_with(p),
    });
    hit != exclude
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_carries_the_store_and_the_secret() {
        let v4 = Rendezvous {
            addr: "10.1.2.3:29500".parse().unwrap(),
            secret: [7; 16],
            job: [9; 16],
        };
        assert_eq!(Rendezvous::decode(&v4.encode()), Ok(v4));
        let v6 = Rendezvous {
            addr: "[fd00::1]:1234".parse().unwrap(),
            ..v4
        };
        assert_eq!(Rendezvous::decode(&v6.encode()), Ok(v6));
        let zeros = UniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        assert!(Rendezvous::decode(&zeros)
            .unwrap_err()
            .contains("ncclGetUniqueId"));
    }

    #[test]
    fn a_served_id_is_handed_over_once() {
        let me = Rendezvous::serve().unwrap();
        assert_ne!(me.addr.port(), 0);
        assert!(me.take_server().is_some());
        assert!(me.take_server().is_none());
    }

    #[test]
    fn interface_filters_read_as_nccls() {
        assert!(allowed("", "eth0"));
        assert!(allowed("eth,ib", "ib0"));
        assert!(!allowed("eth", "ib0"));
        assert!(!allowed("^docker,lo", "docker0"));
        assert!(allowed("^docker", "eth0"));
        assert!(allowed("=eth0", "eth0"));
        assert!(!allowed("=eth0", "eth01"));
    }
}
