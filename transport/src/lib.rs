//! Moving bytes between the ranks of a Chorus job.
//!
//! * [`Transport`]: the contract every transport meets (post sends and
//!   receives of byte ranges, progress in the background, errors that name
//!   the peer rank).
//! * [`tcp::TcpTransport`]: TCP sockets (several per peer, striped), driven
//!   by a progress thread.
//! * [`shm::ShmTransport`]: shared-memory rings between the ranks of a host.
//! * [`RoutedTransport`]: shared memory within a host, TCP across hosts.
//! * [`store`]: the rendezvous key-value store through which ranks find each
//!   other.
//! * [`auth`]: the handshake that keeps other jobs and strangers out.

pub mod auth;
mod endpoint;
mod error;
mod matching;
pub mod pages;
mod peers;
mod request;
mod routed;
pub mod shm;
pub mod store;
pub mod tcp;
mod transport;

pub use error::TransportError;
pub use request::{Completion, CompletionPool, Direction, Idle, Progress, Request};
pub use routed::{host_identity, RouteConfig, RoutedTransport, TransportKind};
pub use transport::{wait_all, Exchange, LinkCost, Payload, Transport};
