//! [`DistributedSampler`]: each rank's share of a data set's indices, per epoch.

use crate::{Error, Result};

/// Splits the indices `0..len` of a data set among `world_size` ranks, with
/// the semantics of PyTorch's `DistributedSampler`.
///
/// Every epoch the indices are shuffled by `seed + epoch` (unless shuffling is
/// off), then either padded by repeating the first indices so that every rank
/// gets `ceil(len / world_size)`, or, with `drop_last`, cut to
/// `floor(len / world_size)` per rank. Rank `r` takes positions
/// `r, r + world_size, r + 2 * world_size, ...`, so the ranks' shards are
/// disjoint (up to the padding) and together cover the data set.
///
/// The permutation comes from a fixed generator (SplitMix64 and a
/// Fisher–Yates shuffle): the same on every rank, machine and run, though not
/// the same permutation PyTorch draws.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    len: usize,
    world_size: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A shuffling, padding sampler over `len` indices for `rank` of `world_size`, seed 0, epoch 0.
    ///
    /// Fails if `world_size` is 0 or `rank` is not below it.
    pub fn new(len: usize, world_size: usize, rank: usize) -> Result<DistributedSampler> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "sampler: rank {rank} is not below world size {world_size}"
            )));
        }
        Ok(DistributedSampler {
            len,
            world_size,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
            epoch: 0,
        })
    }

    /// Shuffles each epoch (the default) or keeps the natural order.
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The seed every rank must share (default 0).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Drops the tail so every rank gets `floor(len / world_size)` indices, instead of padding.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch, which changes the shuffle; call it at the start of every epoch.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How many indices each rank gets per epoch.
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.len / self.world_size
        } else {
            self.len.div_ceil(self.world_size)
        }
    }

    /// This rank's indices for the current epoch, in the order to visit them.
    pub fn indices(&self) -> Vec<usize> {
        let total = self.num_samples() * self.world_size;
        let mut all: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            shuffle(&mut all, self.seed.wrapping_add(self.epoch));
        }
        if self.len > 0 {
            // Pad by repeating from the start (as often as needed), or cut the tail.
            all = all.iter().copied().cycle().take(total).collect();
        }
        all.into_iter()
            .skip(self.rank)
            .step_by(self.world_size)
            .collect()
    }
}

/// SplitMix64: a small, fast generator whose output is fixed by its seed.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (multiply-shift; the bias is below 2^-40 for any data set size).
    fn below(&mut self, n: usize) -> usize {
        ((self.next() as u128 * n as u128) >> 64) as usize
    }
}

/// Fisher–Yates shuffle driven by `seed`.
fn shuffle(items: &mut [usize], seed: u64) {
    let mut rng = SplitMix64(seed);
    for i in (1..items.len()).rev() {
        let j = rng.below(i + 1);
        items.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shards(len: usize, world: usize, drop_last: bool, epoch: u64) -> Vec<Vec<usize>> {
        (0..world)
            .map(|rank| {
                let mut s = DistributedSampler::new(len, world, rank)
                    .unwrap()
                    .seed(7)
                    .drop_last(drop_last);
                s.set_epoch(epoch);
                s.indices()
            })
            .collect()
    }

    #[test]
    fn shards_are_disjoint_and_cover_the_data_set() {
        for (len, world) in [(60, 4), (10, 3), (7, 1), (100, 7)] {
            let shards = shards(len, world, true, 0);
            let mut all: Vec<usize> = shards.concat();
            assert!(shards.iter().all(|s| s.len() == len / world));
            all.sort_unstable();
            let before = all.len();
            all.dedup();
            assert_eq!(all.len(), before, "len {len} world {world}: shards overlap");
            if len % world == 0 {
                assert_eq!(all, (0..len).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn padding_repeats_the_first_indices_to_equal_length() {
        // 10 indices on 4 ranks: 3 each, 2 repeated.
        let shards = shards(10, 4, false, 3);
        assert!(shards.iter().all(|s| s.len() == 3));
        let mut all = shards.concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        // Unshuffled, the exact layout of PyTorch's sampler.
        let plain = |rank| {
            DistributedSampler::new(10, 4, rank)
                .unwrap()
                .shuffle(false)
                .indices()
        };
        assert_eq!(plain(0), vec![0, 4, 8]);
        assert_eq!(plain(1), vec![1, 5, 9]);
        assert_eq!(plain(2), vec![2, 6, 0]);
        assert_eq!(plain(3), vec![3, 7, 1]);
        // Fewer indices than ranks: repeated as often as needed.
        let tiny = DistributedSampler::new(2, 5, 4).unwrap().shuffle(false);
        assert_eq!(tiny.indices(), vec![0]);
        let dropped = DistributedSampler::new(10, 4, 3)
            .unwrap()
            .shuffle(false)
            .drop_last(true);
        assert_eq!(dropped.indices(), vec![3, 7]);
    }

    #[test]
    fn the_same_seed_and_epoch_give_the_same_shards_and_other_epochs_differ() {
        assert_eq!(shards(1000, 4, false, 2), shards(1000, 4, false, 2));
        assert_ne!(shards(1000, 4, false, 2), shards(1000, 4, false, 3));
        let other_seed = DistributedSampler::new(1000, 4, 0).unwrap().seed(8);
        assert_ne!(other_seed.indices(), shards(1000, 4, false, 0)[0]);
    }

    #[test]
    fn one_rank_sees_a_permutation_whose_interleaving_is_the_shards() {
        let whole = {
            let mut s = DistributedSampler::new(64, 1, 0).unwrap().seed(7);
            s.set_epoch(5);
            s.indices()
        };
        let shards = shards(64, 4, false, 5);
        for (rank, shard) in shards.iter().enumerate() {
            let want: Vec<usize> = whole.iter().copied().skip(rank).step_by(4).collect();
            assert_eq!(shard, &want);
        }
    }

    #[test]
    fn bad_rank_or_world_is_an_error() {
        assert!(DistributedSampler::new(10, 0, 0).is_err());
        let e = DistributedSampler::new(10, 2, 2).unwrap_err().to_string();
        assert!(e.contains("rank 2"), "{e}");
        assert!(DistributedSampler::new(0, 2, 1)
            .unwrap()
            .indices()
            .is_empty());
    }
}
