//! Job authentication: every store and transport connection proves that its
//! two ends belong to the same job and know the job's shared secret.
//!
//! The secret (`CHORUS_AUTH_TOKEN`) never crosses the wire. A connection
//! carries an HMAC-SHA256 keyed with it over the job id and values unique to
//! the connection (the store server's random challenge; the transport's
//! session, ranks and socket index). This keeps strangers and other jobs out;
//! it encrypts nothing, and an observer of the network still sees the data.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Length of a MAC on the wire.
pub const MAC_LEN: usize = 32;
/// Length of a challenge nonce.
pub const NONCE_LEN: usize = 16;
/// The longest job id, in bytes.
pub const MAX_JOB_ID_LEN: usize = 255;

type HmacSha256 = Hmac<Sha256>;

/// Why a job identity or a random value could not be made.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The job id is longer than [`MAX_JOB_ID_LEN`] bytes.
    #[error("the job id is {len} bytes; at most {MAX_JOB_ID_LEN} are allowed")]
    JobIdTooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The operating system's random generator failed.
    #[error("no randomness from the OS: {0}")]
    NoRandomness(getrandom::Error),
}

/// A job's identity and shared secret; `Default` is no job id and an empty secret.
///
/// `Debug` never shows the secret.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Auth {
    job_id: String,
    token: Vec<u8>,
}

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let token = if self.token.is_empty() { "none" } else { "set" };
        f.debug_struct("Auth")
            .field("job_id", &self.job_id)
            .field("token", &token)
            .finish()
    }
}

impl Auth {
    /// The identity of job `job_id` whose ranks share `token`.
    ///
    /// Fails if the job id is longer than [`MAX_JOB_ID_LEN`] bytes.
    pub fn new(job_id: impl Into<String>, token: impl Into<Vec<u8>>) -> Result<Auth, AuthError> {
        let job_id = job_id.into();
        if job_id.len() > MAX_JOB_ID_LEN {
            return Err(AuthError::JobIdTooLong { len: job_id.len() });
        }
        Ok(Auth {
            job_id,
            token: token.into(),
        })
    }

    /// The job id.
    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    /// Whether a shared secret is set.
    pub fn has_token(&self) -> bool {
        !self.token.is_empty()
    }

    fn keyed(&self, domain: &str, parts: &[&[u8]]) -> HmacSha256 {
        let mut mac =
            HmacSha256::new_from_slice(&self.token).expect("HMAC takes keys of any length");
        // Every field is length-prefixed, so no two different inputs share an encoding.
        for field in [domain.as_bytes(), self.job_id.as_bytes()]
            .iter()
            .chain(parts)
        {
            mac.update(&(field.len() as u64).to_le_bytes());
            mac.update(field);
        }
        mac
    }

    /// The MAC of `parts` for a use named by `domain`, bound to this job id.
    pub fn mac(&self, domain: &str, parts: &[&[u8]]) -> [u8; MAC_LEN] {
        self.keyed(domain, parts).finalize().into_bytes().into()
    }

    /// Whether `mac` is the MAC of `parts` (compared in constant time).
    pub fn verify(&self, domain: &str, parts: &[&[u8]], mac: &[u8]) -> bool {
        self.keyed(domain, parts).verify_slice(mac).is_ok()
    }
}

/// A fresh random challenge from the operating system's generator.
pub fn nonce() -> Result<[u8; NONCE_LEN], AuthError> {
    let mut bytes = [0u8; NONCE_LEN];
    getrandom::fill(&mut bytes).map_err(AuthError::NoRandomness)?;
    Ok(bytes)
}

/// A fresh random secret, as 32 hex digits (what launchers hand their workers).
pub fn random_token() -> Result<String, AuthError> {
    let bytes = nonce()?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_depend_on_secret_job_domain_and_parts() {
        let auth = Auth::new("job-1", "secret").unwrap();
        let mac = auth.mac("store", &[b"abc"]);
        assert!(auth.verify("store", &[b"abc"], &mac));
        let others = [
            Auth::new("job-1", "other secret").unwrap(),
            Auth::new("job-2", "secret").unwrap(),
        ];
        for other in &others {
            assert!(!other.verify("store", &[b"abc"], &mac), "{other:?}");
        }
        assert!(!auth.verify("tcp", &[b"abc"], &mac));
        assert!(!auth.verify("store", &[b"abd"], &mac));
        // Length prefixes keep field boundaries apart.
        assert!(!auth.verify("store", &[b"ab", b"c"], &mac));
        assert!(!auth.verify("store", &[b"abc"], &mac[..31]));
    }

    #[test]
    fn debug_hides_the_secret() {
        let shown = format!("{:?}", Auth::new("j", "hunter2").unwrap());
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("set"), "{shown}");
    }

    #[test]
    fn long_job_ids_are_refused() {
        assert!(Auth::new("x".repeat(MAX_JOB_ID_LEN), "").is_ok());
        let err = Auth::new("x".repeat(MAX_JOB_ID_LEN + 1), "").unwrap_err();
        assert!(matches!(err, AuthError::JobIdTooLong { len: 256 }), "{err}");
        assert!(err.to_string().contains("256 bytes"), "{err}");
    }

    #[test]
    fn tokens_are_fresh_hex() {
        let (a, b) = (random_token().unwrap(), random_token().unwrap());
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
