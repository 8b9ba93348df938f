//! Reserving rank 0's port: bound before it is published, held until the workers are gone.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};

use socket2::{Domain, Socket, Type};

/// A TCP port held for a process that will listen on it later: the `MASTER_PORT` a launcher
/// gives rank 0, whose store binds it only once it has started.
///
/// Picking a port that "was free a moment ago" and letting rank 0 bind it later races with
/// every other process on the host: any bind to port 0 and any outgoing connection may take
/// the port in between. So the port is bound first and then published: a socket of the
/// launcher's own, with `SO_REUSEADDR`, stays bound to the port on every address of its family
/// (bound, never listening) until the reservation is dropped. On Linux such a socket keeps the
/// port from being handed out to a bind to port 0 or as the local port of a connection, and
/// from any bind without `SO_REUSEADDR`; a socket that names the port and sets `SO_REUSEADDR`
/// (Chorus's store, torch's TCPStore, anything on libuv or Rust's `TcpListener`) may still
/// bind it and listen. Passing the bound
/// listener to rank 0 instead would tie the contract to Chorus: a worker that brings its own
/// store (torch's) needs to bind `MASTER_PORT` itself.
///
/// The socket is close-on-exec: workers do not inherit it, so the port is free again once the
/// launcher drops the reservation and its workers are gone.
#[derive(Debug)]
pub struct PortReservation {
    /// Bound, never listening.
    _socket: Socket,
    port: u16,
}

impl PortReservation {
    /// Reserves a free port for a store that will listen at `host` (an IP address or a name;
    /// `""` and `localhost` mean 127.0.0.1).
    ///
    /// Fails if `host` does not resolve or no socket can be bound.
    pub fn new(host: &str) -> io::Result<PortReservation> {
        PortReservation::at(host, 0)
    }

    /// Reserves `port` (0: any free one) for a store that will listen at `host`, as
    /// [`PortReservation::new`] does; for jobs whose port is fixed in advance (SLURM's comes
    /// from the job id).
    ///
    /// Fails if `host` does not resolve or the port cannot be bound.
    pub fn at(host: &str, port: u16) -> io::Result<PortReservation> {
        let host = match host {
            "" | "localhost" => chorus_env::DEFAULT_MASTER_ADDR,
            other => other,
        };
        let family = (host, 0).to_socket_addrs()?.next().ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, format!("{host} has no address"))
        })?;
        let any: IpAddr = match family {
            SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
            SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
        };
        let addr = SocketAddr::new(any, port);
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        socket.set_reuse_address(true)?;
        socket.bind(&addr.into())?;
        let port = socket
            .local_addr()?
            .as_socket()
            .map(|a| a.port())
            .ok_or_else(|| io::Error::other("the reserved socket has no port"))?;
        Ok(PortReservation {
            _socket: socket,
            port,
        })
    }

    /// The reserved port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    /// A listener like the store's: `SO_REUSEADDR`, on every address.
    fn store_listener(port: u16) -> io::Result<TcpListener> {
        let addr = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port);
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
        socket.set_reuse_address(true)?;
        socket.bind(&addr.into())?;
        socket.listen(16)?;
        Ok(socket.into())
    }

    #[test]
    fn a_reserved_port_is_for_the_store_alone() {
        let reserved = PortReservation::new("127.0.0.1").unwrap();
        let port = reserved.port();
        assert_ne!(port, 0);
        // Nobody binds it without SO_REUSEADDR (which std's listeners set), on loopback or on
        // every address.
        for ip in [Ipv4Addr::LOCALHOST, Ipv4Addr::UNSPECIFIED] {
            let plain = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
            let addr = SocketAddr::new(ip.into(), port);
            assert!(plain.bind(&addr.into()).is_err(), "{addr} was bound");
        }
        // Nothing listens there yet.
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
        // The store binds it, and binds it again after a restart.
        for _ in 0..2 {
            let store = store_listener(port).unwrap();
            let _client = TcpStream::connect(("127.0.0.1", port)).unwrap();
            store.accept().unwrap();
        }
        // Released with the reservation.
        drop(reserved);
        TcpListener::bind(("127.0.0.1", port)).unwrap();
    }

    #[test]
    fn names_and_families() {
        assert_ne!(PortReservation::new("localhost").unwrap().port(), 0);
        assert_ne!(PortReservation::new("").unwrap().port(), 0);
        assert!(PortReservation::new("no-such-host.invalid").is_err());
    }
}
