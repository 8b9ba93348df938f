//! Checkpoints: parameters, momentum and history after an epoch, written atomically.
//!
//! Layout: the magic line, a little-endian `u64` header length, the JSON
//! header ([`Header`]), then every parameter and every momentum buffer as
//! little-endian `f32`, in registration order. Floats are stored bit for bit,
//! so a resumed run continues exactly where the saved one stopped.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::file::write_atomically;
use super::report::EpochLog;

/// First bytes of every checkpoint.
const MAGIC: &[u8] = b"CHORUS-TRAIN-CHECKPOINT-1\n";

/// What a checkpoint says besides the numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// Epochs completed.
    pub epochs_done: u64,
    /// Layer widths of the network.
    pub widths: Vec<usize>,
    /// The seed of initialisation and shuffling.
    pub seed: u64,
    /// World size and per-rank batch the epochs so far ran with.
    pub world_size: usize,
    /// Per-rank batch size.
    pub batch_size: usize,
    /// Length of each parameter (and momentum buffer).
    pub lens: Vec<usize>,
    /// One entry per completed epoch.
    pub history: Vec<EpochLog>,
}

/// A checkpoint's contents.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// The header.
    pub header: Header,
    /// Parameter values.
    pub params: Vec<Vec<f32>>,
    /// Momentum buffers.
    pub momentum: Vec<Vec<f32>>,
}

impl Checkpoint {
    /// Writes to `path` through a temporary file in the same directory and a rename,
    /// so a crash leaves the old checkpoint or the new one, never half of one.
    ///
    /// Fails naming the file on an I/O error.
    pub fn save(&self, path: &Path) -> Result<(), String> {
        let header = serde_json::to_vec(&self.header).map_err(|e| e.to_string())?;
        let mut bytes = Vec::with_capacity(
            MAGIC.len() + 8 + header.len() + 8 * self.header.lens.iter().sum::<usize>(),
        );
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&(header.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&header);
        for v in self.params.iter().chain(&self.momentum).flatten() {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        write_atomically(path, &bytes)
    }

    /// Reads a checkpoint written by [`save`](Self::save).
    ///
    /// Fails naming the file if it is missing, not a checkpoint, or truncated.
    pub fn load(path: &Path) -> Result<Checkpoint, String> {
        let what = path.display();
        let bytes = std::fs::read(path).map_err(|e| format!("{what}: {e}"))?;
        let rest = bytes
            .strip_prefix(MAGIC)
            .ok_or_else(|| format!("{what}: not a Chorus training checkpoint"))?;
        let (len, rest) = rest
            .split_first_chunk::<8>()
            .ok_or_else(|| format!("{what}: truncated header"))?;
        let len = u64::from_le_bytes(*len) as usize;
        if rest.len() < len {
            return Err(format!("{what}: truncated header"));
        }
        let (header, mut data) = rest.split_at(len);
        let header: Header =
            serde_json::from_slice(header).map_err(|e| format!("{what}: bad header: {e}"))?;
        let floats: usize = header.lens.iter().sum();
        if data.len() != 8 * floats {
            return Err(format!(
                "{what}: {} bytes of values, expected {} (truncated or corrupt)",
                data.len(),
                8 * floats
            ));
        }
        let mut take = |n: usize| -> Vec<f32> {
            let (head, tail) = data.split_at(4 * n);
            data = tail;
            head.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        };
        let params = header.lens.iter().map(|&n| take(n)).collect();
        let momentum = header.lens.iter().map(|&n| take(n)).collect();
        Ok(Checkpoint {
            header,
            params,
            momentum,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_round_trips_bit_for_bit_and_damage_is_an_error() {
        let dir = std::env::temp_dir().join(format!("chorus-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("checkpoint.bin");
        let ckpt = Checkpoint {
            header: Header {
                epochs_done: 2,
                widths: vec![2, 1],
                seed: 9,
                world_size: 2,
                batch_size: 4,
                lens: vec![2, 1],
                history: vec![],
            },
            params: vec![vec![0.1, -0.0], vec![f32::MIN_POSITIVE]],
            momentum: vec![vec![1e-30, 3.5], vec![-2.0]],
        };
        ckpt.save(&path).unwrap();
        let back = Checkpoint::load(&path).unwrap();
        assert_eq!(back, ckpt);
        assert!(back.params[0][1].is_sign_negative());
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        assert!(Checkpoint::load(&path).unwrap_err().contains("truncated"));
        std::fs::write(&path, b"hello").unwrap();
        assert!(Checkpoint::load(&path)
            .unwrap_err()
            .contains("not a Chorus training checkpoint"));
        assert!(Checkpoint::load(&dir.join("none")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
