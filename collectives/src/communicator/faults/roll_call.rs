//! The roll call before ranks connect: every rank number is claimed by one process only,
//! and every rank's settings that must match (world size, transport, sockets per peer,
//! forced algorithms, the tuner's link figures, chunk size) agree with rank 0's. A
//! disagreement fails at once, naming it, instead of as a timeout or a corrupted stream later.

use chorus_transport::store::Store;

use crate::{env, Config, Error, Result};

/// The settings every rank must share, as `(variable, value)` in a fixed order.
fn settings(config: &Config) -> Vec<(&'static str, String)> {
    vec![
        (env::WORLD_SIZE, config.world_size.to_string()),
        (env::CHORUS_TRANSPORT, config.transport.to_string()),
        (env::CHORUS_NSOCKS, config.nsocks.to_string()),
        (env::CHORUS_ALGO, config.algo.to_string()),
        // The tuner's figures: ranks that price calls apart can pick different algorithms.
        (env::CHORUS_ALPHA_US, figure(config.alpha, 1e6)),
        (env::CHORUS_BANDWIDTH_GBS, figure(config.beta, 1e-9)),
        (env::CHORUS_CHUNK_BYTES, config.chunk_bytes.to_string()),
    ]
}

/// A tuner figure in its variable's unit (`value` times `unit`, to 6 decimals), or "unset".
fn figure(value: Option<f64>, unit: f64) -> String {
    let Some(v) = value else {
        return "unset".into();
    };
    let text = format!("{:.6}", v * unit);
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn encode(settings: &[(&str, String)]) -> Vec<u8> {
    let lines: Vec<String> = settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
    lines.join("\n").into_bytes()
}

/// Claims `config.rank` for this process.
///
/// Fails with [`Error::Config`] when another process already claimed the rank number.
pub(super) fn claim<S: Store + ?Sized>(store: &S, config: &Config) -> Result<()> {
    let rank = config.rank;
    if store.add(&format!("claim/{rank}"), 1)? > 1 {
        return Err(Error::Config {
            var: env::RANK,
            value: rank.to_string(),
            reason: format!(
                "another process of this job already has rank {rank}: each rank number must go to one process"
            ),
        });
    }
    Ok(())
}

/// Checks this rank's settings against rank 0's.
///
/// Fails with [`Error::Config`] naming the first setting that differs from rank 0's.
pub(super) fn compare<S: Store + ?Sized>(store: &S, config: &Config) -> Result<()> {
    let rank = config.rank;
    let mine = settings(config);
    store.set(&format!("settings/{rank}"), &encode(&mine))?;
    if rank == 0 {
        return Ok(());
    }
    store.wait(&["settings/0"], config.timeout)?;
    let theirs = String::from_utf8_lossy(&store.get("settings/0")?).into_owned();
    for (var, value) in &mine {
        let said = theirs
            .lines()
            .find_map(|line| line.strip_prefix(var)?.strip_prefix('='))
            .unwrap_or("");
        if said != value {
            return Err(Error::Config {
                var,
                value: value.clone(),
                reason: format!(
                    "rank {rank} says {var}={value}, rank 0 says {var}={said}: every rank of a job must agree"
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::Duration;

    use chorus_transport::store::{StoreServer, TcpStore};

    use super::*;

    fn roll_call(store: &TcpStore, config: &Config) -> Result<()> {
        claim(store, config)?;
        compare(store, config)
    }

    fn config(rank: usize, world_size: usize) -> Config {
        let mut config = Config::new(rank, world_size, "127.0.0.1", 0);
        config.timeout = Duration::from_secs(10);
        config
    }

    fn store() -> (StoreServer, TcpStore) {
        let server = StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        let port = server.local_addr().port();
        let client = TcpStore::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap();
        (server, client)
    }

    #[test]
    fn ranks_that_agree_pass() {
        let (_server, store) = store();
        for rank in 0..3 {
            roll_call(&store, &config(rank, 3)).unwrap();
        }
    }

    #[test]
    fn a_rank_claimed_twice_is_refused() {
        let (_server, store) = store();
        roll_call(&store, &config(0, 3)).unwrap();
        roll_call(&store, &config(1, 3)).unwrap();
        let err = roll_call(&store, &config(1, 3)).unwrap_err().to_string();
        assert!(err.contains("already has rank 1"), "{err}");
    }

    #[test]
    fn the_first_setting_that_differs_from_rank_0s_is_named() {
        let (_server, store) = store();
        roll_call(&store, &config(0, 2)).unwrap();
        let err = roll_call(&store, &config(1, 3)).unwrap_err().to_string();
        assert!(
            err.contains("rank 1 says WORLD_SIZE=3, rank 0 says WORLD_SIZE=2"),
            "{err}"
        );
        let mut other = config(1, 2);
        other.nsocks += 1;
        let (_server, store) = self::store();
        roll_call(&store, &config(0, 2)).unwrap();
        let err = roll_call(&store, &other).unwrap_err().to_string();
        assert!(err.contains("CHORUS_NSOCKS"), "{err}");
        // The tuner's figures too, set on one rank only.
        let mut other = config(1, 2);
        other.alpha = Some(5e-6);
        let (_server, store) = self::store();
        roll_call(&store, &config(0, 2)).unwrap();
        let err = roll_call(&store, &other).unwrap_err();
        let Error::Config { var, value, .. } = &err else {
            panic!("not a configuration error: {err:?}");
        };
        assert_eq!((*var, value.as_str()), ("CHORUS_ALPHA_US", "5"), "{err}");
    }
}
