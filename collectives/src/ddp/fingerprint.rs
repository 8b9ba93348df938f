//! The check that every rank registered the same parameters, in the same order.

use super::bucket::ParamSpec;
use crate::{Communicator, Error, ReduceOp, Result};

/// No parameter differs.
const NONE: u64 = u64::MAX;

/// FNV-1a over a parameter's name, length and type: the same on every machine.
fn hash(p: &ParamSpec) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let len = (p.len as u64).to_le_bytes();
    for b in p
        .name
        .bytes()
        .chain([0])
        .chain(len)
        .chain(p.dtype.name().bytes())
    {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Fails on every rank, naming the first differing parameter, unless all ranks registered `params`.
///
/// A collective: every rank must call it. Two small collectives when the lists agree.
pub(crate) fn check(comm: &Communicator, params: &[ParamSpec]) -> Result<()> {
    let mine: Vec<u64> = params.iter().map(hash).collect();
    let whole = mine
        .iter()
        .fold(mine.len() as u64, |acc, h| acc.rotate_left(5) ^ h);
    let mut head = [mine.len() as u64, whole];
    comm.broadcast(&mut head, 0)?;
    let mut differs = [u64::from(head != [mine.len() as u64, whole])];
    comm.all_reduce(&mut differs, ReduceOp::Max)?;
    if differs[0] == 0 {
        return Ok(());
    }
    // Find the first position where some rank disagrees with rank 0, and who.
    let mut theirs = if comm.rank() == 0 {
        mine.clone()
    } else {
        vec![0; head[0] as usize]
    };
    comm.broadcast(&mut theirs, 0)?;
    let first = mine
        .iter()
        .zip(&theirs)
        .position(|(a, b)| a != b)
        .or((mine.len() != theirs.len()).then(|| mine.len().min(theirs.len())))
        .map_or(NONE, |i| i as u64);
    let mut at = [first];
    comm.all_reduce(&mut at, ReduceOp::Min)?;
    let at = at[0] as usize;
    let describe = |rank: usize| match params.get(at) {
        Some(p) => format!("rank {rank} has {p}"),
        None => format!("rank {rank} has only {} parameters", params.len()),
    };
    let mut who = [if first == at as u64 {
        comm.rank() as u64
    } else {
        NONE
    }];
    comm.all_reduce(&mut who, ReduceOp::Min)?;
    let zero = share_text(comm, 0, &describe(0))?;
    let other = share_text(comm, who[0] as usize, &describe(who[0] as usize))?;
    Err(Error::InvalidArgument(format!(
        "ranks registered different parameters: at parameter #{at}, {zero}, {other}"
    )))
}

/// `root`'s `text`, on every rank.
fn share_text(comm: &Communicator, root: usize, text: &str) -> Result<String> {
    let mut len = [text.len() as u64];
    comm.broadcast(&mut len, root)?;
    let mut bytes = if comm.rank() == root {
        text.as_bytes().to_vec()
    } else {
        vec![0u8; len[0] as usize]
    };
    comm.broadcast(&mut bytes, root)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn the_hash_sees_name_length_and_type() {
        let p = ParamSpec::new("w", 10, DType::F32);
        // FNV-1a of "w", 0, 10 as 8 little-endian bytes, "float": the same on every machine.
        assert_eq!(hash(&p), 0x2e31_5801_202e_4db2);
        assert_ne!(hash(&p), hash(&ParamSpec::new("v", 10, DType::F32)));
        assert_ne!(hash(&p), hash(&ParamSpec::new("w", 11, DType::F32)));
        assert_ne!(hash(&p), hash(&ParamSpec::new("w", 10, DType::BF16)));
    }
}
