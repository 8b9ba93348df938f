//! The store's connection handshake: challenge, answer, verdict.
//!
//! ```text
//! server -> client  CHALLENGE  magic "CHSA" (4) | nonce (16)
//! client -> server  ANSWER     magic "CHSA" (4) | job id length u8 (1) | job id | MAC (32)
//! server -> client  VERDICT    0 (accepted), or 1 | message length u8 | UTF-8 message
//! ```
//!
//! The MAC is [`Auth::mac`] over the nonce, so an answer cannot be replayed on
//! another connection. Requests flow only after an accepting verdict; the
//! server drops a connection whose answer is malformed or wrong.

use std::io::{Read, Write};
use std::net::TcpStream;

use super::StoreError;
use crate::auth::{Auth, MAC_LEN, MAX_JOB_ID_LEN, NONCE_LEN};

/// Opens the challenge and the answer.
pub const MAGIC: [u8; 4] = *b"CHSA";
/// Length of the challenge frame.
pub const CHALLENGE_LEN: usize = 4 + NONCE_LEN;
/// The domain separating store MACs from transport MACs.
const DOMAIN: &str = "chorus-store";
const ACCEPTED: u8 = 0;
const REFUSED: u8 = 1;

/// The server's challenge frame for `nonce`.
pub fn challenge(nonce: &[u8; NONCE_LEN]) -> [u8; CHALLENGE_LEN] {
    let mut frame = [0u8; CHALLENGE_LEN];
    frame[..4].copy_from_slice(&MAGIC);
    frame[4..].copy_from_slice(nonce);
    frame
}

/// The client's answer to a challenge frame; fails if the frame is not a Chorus store's.
pub fn answer(auth: &Auth, challenge: &[u8; CHALLENGE_LEN]) -> Result<Vec<u8>, StoreError> {
    if challenge[..4] != MAGIC {
        return Err(StoreError::Protocol(
            "the server did not open with a Chorus store challenge (is MASTER_PORT another service's port?)".into(),
        ));
    }
    let job = auth.job_id().as_bytes();
    let mut frame = Vec::with_capacity(5 + job.len() + MAC_LEN);
    frame.extend_from_slice(&MAGIC);
    frame.push(job.len() as u8);
    frame.extend_from_slice(job);
    frame.extend_from_slice(&auth.mac(DOMAIN, &[&challenge[4..]]));
    Ok(frame)
}

/// A decoded answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The job the client claims to belong to.
    pub job_id: String,
    /// Its MAC over the challenge.
    pub mac: [u8; MAC_LEN],
}

/// Decodes an answer from the start of `buf`: `Ok(None)` until it is complete.
///
/// Fails on a wrong magic number or a job id that is not UTF-8, before buffering more.
pub fn decode_answer(buf: &[u8]) -> Result<Option<(Answer, usize)>, StoreError> {
    let have = buf.len().min(4);
    if buf[..have] != MAGIC[..have] {
        return Err(StoreError::Protocol(
            "a client opened with something other than a Chorus store answer".into(),
        ));
    }
    let Some(&len) = buf.get(4) else {
        return Ok(None);
    };
    let len = usize::from(len);
    let total = 5 + len + MAC_LEN;
    if buf.len() < total {
        return Ok(None);
    }
    let job_id = std::str::from_utf8(&buf[5..5 + len])
        .map_err(|_| StoreError::Protocol("a client sent a job id that is not UTF-8".into()))?;
    let mac = buf[5 + len..total].try_into().expect("MAC_LEN bytes");
    let answer = Answer {
        job_id: job_id.to_string(),
        mac,
    };
    Ok(Some((answer, total)))
}

/// The largest answer frame.
pub const MAX_ANSWER_LEN: usize = 5 + MAX_JOB_ID_LEN + MAC_LEN;

/// Checks an answer against this job; the error says why it is refused.
pub fn check(auth: &Auth, nonce: &[u8; NONCE_LEN], answer: &Answer) -> Result<(), String> {
    if answer.job_id != auth.job_id() {
        return Err(format!(
            "the client belongs to job {:?}, this store to job {:?}",
            answer.job_id,
            auth.job_id()
        ));
    }
    if !auth.verify(DOMAIN, &[nonce], &answer.mac) {
        return Err("wrong shared secret (does CHORUS_AUTH_TOKEN match on every rank?)".into());
    }
    Ok(())
}

/// The verdict frame: accepted, or refused with `reason`.
pub fn verdict(outcome: &Result<(), String>) -> Vec<u8> {
    match outcome {
        Ok(()) => vec![ACCEPTED],
        Err(reason) => {
            let reason = &reason.as_bytes()[..reason.len().min(255)];
            let mut frame = vec![REFUSED, reason.len() as u8];
            frame.extend_from_slice(reason);
            frame
        }
    }
}

/// Runs the client's side on a fresh blocking connection (read/write timeouts already set).
pub fn client(stream: &mut TcpStream, auth: &Auth) -> Result<(), StoreError> {
    let io = |what: &str| {
        let what = what.to_string();
        move |e: std::io::Error| {
            let hint = match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    " (timed out: is MASTER_PORT a Chorus store's port?)"
                }
                _ => "",
            };
            StoreError::io(format!("store handshake: {what}{hint}"), e)
        }
    };
    let mut challenge = [0u8; CHALLENGE_LEN];
    stream
        .read_exact(&mut challenge)
        .map_err(io("reading the challenge"))?;
    stream
        .write_all(&answer(auth, &challenge)?)
        .map_err(io("sending the answer"))?;
    let mut status = [0u8; 1];
    stream
        .read_exact(&mut status)
        .map_err(io("reading the verdict"))?;
    if status[0] == ACCEPTED {
        return Ok(());
    }
    let mut len = [0u8; 1];
    let mut reason = vec![0u8; 255];
    let reason = match stream.read_exact(&mut len) {
        Ok(()) => {
            let reason = &mut reason[..usize::from(len[0])];
            stream
                .read_exact(reason)
                .map(|()| String::from_utf8_lossy(reason).into_owned())
        }
        Err(e) => Err(e),
    };
    Err(StoreError::Refused(
        reason.unwrap_or_else(|e| format!("no reason given ({e})")),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(job: &str, token: &str) -> Auth {
        Auth::new(job, token).unwrap()
    }

    #[test]
    fn an_answer_is_accepted_by_its_own_job_only() {
        let nonce = [7u8; NONCE_LEN];
        let frame = answer(&auth("job", "s3cret"), &challenge(&nonce)).unwrap();
        let (decoded, used) = decode_answer(&frame).unwrap().unwrap();
        assert_eq!(used, frame.len());
        assert_eq!(check(&auth("job", "s3cret"), &nonce, &decoded), Ok(()));
        let wrong_secret = check(&auth("job", "other"), &nonce, &decoded).unwrap_err();
        assert!(wrong_secret.contains("CHORUS_AUTH_TOKEN"), "{wrong_secret}");
        let other_job = check(&auth("job2", "s3cret"), &nonce, &decoded).unwrap_err();
        assert!(other_job.contains("\"job\""), "{other_job}");
        // A replay against another challenge fails.
        assert!(check(&auth("job", "s3cret"), &[8u8; NONCE_LEN], &decoded).is_err());
    }

    #[test]
    fn answers_decode_only_when_complete() {
        let frame = answer(&auth("a-job", "k"), &challenge(&[1; NONCE_LEN])).unwrap();
        for cut in 0..frame.len() {
            assert_eq!(decode_answer(&frame[..cut]).unwrap(), None, "cut at {cut}");
        }
        assert!(decode_answer(b"GET ").is_err());
        assert!(decode_answer(b"CH").unwrap().is_none());
        assert!(decode_answer(b"CX").is_err());
    }

    #[test]
    fn a_foreign_challenge_is_refused() {
        let mut frame = challenge(&[0; NONCE_LEN]);
        frame[0] = b'H';
        assert!(answer(&Auth::default(), &frame).is_err());
    }

    #[test]
    fn verdicts_carry_the_reason() {
        assert_eq!(verdict(&Ok(())), vec![0]);
        let frame = verdict(&Err("nope".into()));
        assert_eq!(frame, [&[1u8, 4][..], b"nope"].concat());
        assert_eq!(verdict(&Err("x".repeat(300))).len(), 2 + 255);
    }
}
