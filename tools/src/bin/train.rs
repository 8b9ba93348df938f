//! `train`: data-parallel MLP training on Fashion-MNIST.
//!
//! `train -np 2` starts two local ranks; under chorusrun, torchrun, SLURM or
//! mpirun it runs as one rank. See `train --help`.

fn main() -> std::process::ExitCode {
    chorus_tools::train::main()
}
