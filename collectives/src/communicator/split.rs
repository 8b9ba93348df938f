//! Sub-communicators: `split` by color and key (like `ncclCommSplit` and
//! `MPI_Comm_split`), and `dup`.
//!
//! Every rank publishes (color, key, host) in the rendezvous store; ranks
//! sharing a color form a new communicator, numbered by (key, old rank),
//! with its own connections, so it runs concurrently with its parent. Faults
//! travel between them: see [`Monitor`](super::faults::Monitor).

use std::sync::Arc;

use chorus_transport::store::{PrefixStore, Store};

use super::faults::Lineage;
use super::{lock, Communicator};
use crate::{Error, Result};

impl Communicator {
    /// Splits this communicator: ranks passing the same `color` form a new one,
    /// ordered by `key` then by their rank here; `None` opts out (returns `None`).
    ///
    /// A collective call: every rank must call it, in the same order as its
    /// other collectives. Fails if the exchange or the new connections fail.
    ///
    /// A fault the new communicator finds (a dead rank, a mismatched call, a stall) fails
    /// this one and its other splits too, on every rank, and the alarm's text names the
    /// job's ranks.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let ticket = self.inner.ticket();
        let mut split = None;
        self.inner.run_with(ticket, |inner, state| {
            let n = state.splits;
            state.splits += 1;
            split = inner.split(n, color, key)?;
            Ok(())
        })?;
        Ok(split)
    }

    /// A new communicator over the same ranks, with its own connections.
    ///
    /// A collective call; fails as [`split`](Self::split) does.
    pub fn dup(&self) -> Result<Communicator> {
        let me = self.rank() as i64;
        self.split(Some(0), me)?
            .ok_or_else(|| Error::Internal("dup produced no communicator".into()))
    }
}

impl super::Inner {
    fn split(&self, n: u64, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let config = &self.config;
        let host = crate::hostname();
        let members: Vec<(Option<u32>, i64, String)> = match &self.store {
            None => vec![(color, key, host.clone())],
            Some((client, prefix)) => {
                let store = PrefixStore::new(format!("{prefix}/split{n}"), Arc::clone(client));
                let mine = format!(
                    "{}:{key}:{host}",
                    color.map_or("-".to_string(), |c| c.to_string())
                );
                store.set(&format!("member/{}", config.rank), mine.as_bytes())?;
                (0..config.world_size)
                    .map(|r| parse_member(r, &store.get(&format!("member/{r}"))?))
                    .collect::<Result<_>>()?
            }
        };
        let Some(color) = color else { return Ok(None) };
        let mut group: Vec<usize> = (0..members.len())
            .filter(|&r| members[r].0 == Some(color))
            .collect();
        group.sort_by_key(|&r| (members[r].1, r));
        let position = |ranks: &[usize]| {
            ranks
                .iter()
                .position(|&r| r == config.rank)
                .expect("this rank is a member")
        };
        let local: Vec<usize> = group
            .iter()
            .copied()
            .filter(|&r| members[r].2 == host)
            .collect();
        let mut sub = config.clone();
        sub.rank = position(&group);
        sub.world_size = group.len();
        sub.local_rank = position(&local);
        sub.local_world_size = local.len();
        tracing::info!(
            parent_rank = config.rank,
            color,
            rank = sub.rank,
            world_size = sub.world_size,
            "split"
        );
        let comm = match &self.store {
            Some((client, prefix)) if sub.world_size > 1 => {
                let prefix = format!("{prefix}/split{n}/color{color}");
                let lineage = self.monitor.as_ref().map(|parent| Lineage {
                    job_ranks: group.iter().map(|&r| parent.job_ranks()[r]).collect(),
                    parent: Some(Arc::clone(parent)),
                });
                Communicator::join(
                    sub,
                    Arc::clone(client),
                    prefix,
                    self.server.clone(),
                    lineage,
                    self.lifeline.as_ref().map(|l| l.subset(&group)),
                )?
            }
            _ => Communicator::assemble(sub, None, None),
        };
        let mut children = lock(&self.children);
        children.retain(|c| c.strong_count() > 0);
        children.push(Arc::downgrade(&comm.inner));
        Ok(Some(comm))
    }
}

/// Parses a published "color:key:host" entry of `rank`.
fn parse_member(rank: usize, raw: &[u8]) -> Result<(Option<u32>, i64, String)> {
    let text = String::from_utf8_lossy(raw);
    let mut parts = text.splitn(3, ':');
    let bad = || {
        Error::InvalidArgument(format!(
            "rank {rank} published a malformed split entry {text:?}"
        ))
    };
    let color = match parts.next().ok_or_else(bad)? {
        "-" => None,
        c => Some(c.parse().map_err(|_| bad())?),
    };
    let key = parts.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
    let host = parts.next().ok_or_else(bad)?.to_string();
    Ok((color, key, host))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_parse_and_reject_garbage() {
        assert_eq!(
            parse_member(0, b"3:-7:node1").unwrap(),
            (Some(3), -7, "node1".into())
        );
        assert_eq!(
            parse_member(0, b"-:0:a:b").unwrap(),
            (None, 0, "a:b".into())
        );
        assert!(parse_member(2, b"x:1:h")
            .unwrap_err()
            .to_string()
            .contains("rank 2"));
    }
}
