//! [`Grid`]: a world of `D x P` ranks as `D` pipeline replicas of `P` stages.

use crate::{Communicator, Error, Result};

/// This rank's place in a two-dimensional layout, and its two groups.
///
/// Rank `r` of the world is stage `r % P` of replica `r / P`: a replica's
/// stages are consecutive ranks (so on hosts of `P` or a multiple of `P`
/// ranks, activations never leave the host), and data parallelism runs across
/// replicas between the ranks that hold the same stage. Errors on `data` and
/// `pipeline` name ranks within them; [`rank_of`](Self::rank_of) maps back.
#[derive(Debug)]
pub struct Grid {
    /// This rank's replica, in `0..dp`.
    pub replica: usize,
    /// This rank's stage, in `0..pp`.
    pub stage: usize,
    /// Number of replicas `D`.
    pub dp: usize,
    /// Number of stages `P`.
    pub pp: usize,
    /// The ranks holding this stage, one per replica (rank here = replica).
    pub data: Communicator,
    /// This replica's stages (rank here = stage), for [`Stage`](super::Stage).
    pub pipeline: Communicator,
}

impl Grid {
    /// Splits `world` into `dp` replicas of `pp` stages.
    ///
    /// A collective: every rank calls it with the same sizes. Fails if
    /// `dp * pp` is not the world size, or as [`Communicator::split`] does.
    pub fn new(world: &Communicator, dp: usize, pp: usize) -> Result<Grid> {
        if dp == 0 || pp == 0 || dp * pp != world.world_size() {
            return Err(Error::InvalidArgument(format!(
                "{dp} data-parallel x {pp} pipeline ranks do not make a world of {}",
                world.world_size()
            )));
        }
        let (replica, stage) = (world.rank() / pp, world.rank() % pp);
        let split = |color: usize, key: usize| -> Result<Communicator> {
            world.split(Some(color as u32), key as i64)?.ok_or_else(|| {
                Error::Internal("split with a color returned no communicator".into())
            })
        };
        let data = split(stage, replica)?;
        let pipeline = split(replica, stage)?;
        Ok(Grid {
            replica,
            stage,
            dp,
            pp,
            data,
            pipeline,
        })
    }

    /// The world rank of `stage` in `replica`.
    pub fn rank_of(&self, replica: usize, stage: usize) -> usize {
        replica * self.pp + stage
    }
}
