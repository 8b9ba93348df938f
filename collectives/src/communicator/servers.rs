//! Store servers this process runs, found again by the other communicators of the process
//! that need the same one, so each lives as long as any of them uses it.

use std::sync::{Arc, Mutex, Weak};

use chorus_transport::store::StoreServer;

use super::lock;
use crate::Result;

/// Live servers under the keys that find them.
pub(crate) struct Servers<K>(Mutex<Vec<(K, Weak<StoreServer>)>>);

impl<K: PartialEq> Servers<K> {
    /// No servers.
    pub const fn new() -> Self {
        Servers(Mutex::new(Vec::new()))
    }

    /// The live server kept under `key`, else `start`'s, kept under it (one lock around
    /// both, so two threads asking at once share one server).
    pub fn find_or(
        &self,
        key: K,
        start: impl FnOnce() -> Result<Arc<StoreServer>>,
    ) -> Result<Arc<StoreServer>> {
        let mut servers = lock(&self.0);
        if let Some(server) = live(&servers, &key) {
            return Ok(server);
        }
        let server = start()?;
        servers.retain(|(_, server)| server.strong_count() > 0);
        servers.push((key, Arc::downgrade(&server)));
        Ok(server)
    }

    /// Keeps `server` under `key` while it lives.
    pub fn keep(&self, key: K, server: &Arc<StoreServer>) {
        let mut servers = lock(&self.0);
        servers.retain(|(_, server)| server.strong_count() > 0);
        servers.push((key, Arc::downgrade(server)));
    }

    /// The live server kept under `key`, if any.
    pub fn find(&self, key: &K) -> Option<Arc<StoreServer>> {
        live(&lock(&self.0), key)
    }
}

fn live<K: PartialEq>(servers: &[(K, Weak<StoreServer>)], key: &K) -> Option<Arc<StoreServer>> {
    servers
        .iter()
        .filter(|(k, _)| k == key)
        .find_map(|(_, server)| server.upgrade())
}
