//! A multi-layer perceptron (linear layers with ReLU between them, softmax
//! cross-entropy on top) whose backward pass writes gradients straight into
//! the reducer's buckets ([`Ddp`] or [`Zero`]) and marks each ready as soon as
//! it is complete. A pipeline stage runs a contiguous run of its layers
//! ([`Mlp::stage`]).

use std::ops::Range;

use chorus::ddp::{Ddp, ParamSpec};
use chorus::zero::Zero;
use chorus::DType;
use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2};

/// The network's shape: layer widths from input to classes, e.g. `[784, 256, 128, 10]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mlp {
    widths: Vec<usize>,
    /// Whether the last layer's output passes a ReLU: a stage before the last one.
    relu_out: bool,
}

/// Where backward puts each parameter's gradient: a reducer's buckets.
pub trait Gradients {
    /// Parameter `param`'s gradient, to accumulate into.
    fn grad_mut(&mut self, param: usize) -> chorus::Result<&mut [f32]>;
    /// Says that `param`'s gradient is complete for this step.
    fn mark_ready(&mut self, param: usize) -> chorus::Result<()>;
}

impl Gradients for Ddp<'_> {
    fn grad_mut(&mut self, param: usize) -> chorus::Result<&mut [f32]> {
        Ddp::grad_mut::<f32>(self, param)
    }
    fn mark_ready(&mut self, param: usize) -> chorus::Result<()> {
        Ddp::mark_ready(self, param)
    }
}

impl Gradients for Zero<'_> {
    fn grad_mut(&mut self, param: usize) -> chorus::Result<&mut [f32]> {
        Zero::grad_mut(self, param)
    }
    fn mark_ready(&mut self, param: usize) -> chorus::Result<()> {
        Zero::mark_ready(self, param)
    }
}

/// Per-batch scratch: each layer's output and the gradient flowing back.
#[derive(Debug, Default)]
pub struct Workspace {
    /// Output of every layer (after ReLU except the last: the logits).
    outs: Vec<Vec<f32>>,
    /// Gradient with respect to the current layer's output, and the one below it.
    delta: Vec<f32>,
    below: Vec<f32>,
}

/// Loss and correct predictions summed over a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Score {
    /// Sum of the cross-entropy losses.
    pub loss: f64,
    /// Number of samples whose largest logit is the label.
    pub correct: usize,
}

impl Mlp {
    /// A network with these layer widths (at least input and output).
    ///
    /// Fails if there are fewer than two widths or one is zero.
    pub fn new(widths: Vec<usize>) -> Result<Mlp, String> {
        if widths.len() < 2 || widths.contains(&0) {
            return Err(format!(
                "the network needs an input and an output width, all positive; got {widths:?}"
            ));
        }
        Ok(Mlp {
            widths,
            relu_out: false,
        })
    }

    /// The stage of this network that runs `layers` (its output passes a ReLU
    /// unless it ends with the last layer); its parameters are this network's
    /// [`param_range`](Self::param_range) of them.
    pub fn stage(&self, layers: Range<usize>) -> Mlp {
        Mlp {
            widths: self.widths[layers.start..=layers.end].to_vec(),
            relu_out: layers.end < self.layers() || self.relu_out,
        }
    }

    /// The indices of `layers`' parameters among this network's.
    pub fn param_range(layers: Range<usize>) -> Range<usize> {
        2 * layers.start..2 * layers.end
    }

    /// Layer widths, input first.
    pub fn widths(&self) -> &[usize] {
        &self.widths
    }

    /// Number of linear layers.
    pub fn layers(&self) -> usize {
        self.widths.len() - 1
    }

    /// The parameters in use order: `fc1.weight`, `fc1.bias`, `fc2.weight`, ...
    pub fn params(&self) -> Vec<ParamSpec> {
        (0..self.layers())
            .flat_map(|l| {
                let (fan_in, fan_out) = (self.widths[l], self.widths[l + 1]);
                [
                    ParamSpec::new(format!("fc{}.weight", l + 1), fan_in * fan_out, DType::F32),
                    ParamSpec::new(format!("fc{}.bias", l + 1), fan_out, DType::F32),
                ]
            })
            .collect()
    }

    /// Initial values, PyTorch's default for linear layers: uniform in ±1/sqrt(fan_in), from `seed`.
    pub fn init(&self, seed: u64) -> Vec<Vec<f32>> {
        let mut state = seed ^ 0x5DEE_CE66_D1CE_4E5B;
        let mut uniform = move || {
            // SplitMix64, top 24 bits as a fraction in [0, 1).
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
        };
        self.params()
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let bound = 1.0 / (self.widths[i / 2] as f32).sqrt();
                (0..p.len)
                    .map(|_| (2.0 * uniform() - 1.0) * bound)
                    .collect()
            })
            .collect()
    }

    /// Runs the batch `x` (`rows` images) forward; the logits are left in `ws`.
    pub fn forward(&self, params: &[Vec<f32>], x: &[f32], rows: usize, ws: &mut Workspace) {
        ws.outs.resize_with(self.layers(), Vec::new);
        for l in 0..self.layers() {
            let (fan_in, fan_out) = (self.widths[l], self.widths[l + 1]);
            let (done, rest) = ws.outs.split_at_mut(l);
            let input = if l == 0 { x } else { &done[l - 1][..] };
            let out = &mut rest[0];
            out.clear();
            let bias = &params[2 * l + 1];
            for _ in 0..rows {
                out.extend_from_slice(bias);
            }
            general_mat_mul(
                1.0,
                &view(input, rows, fan_in),
                &view(&params[2 * l], fan_in, fan_out),
                1.0,
                &mut view_mut(out, rows, fan_out),
            );
            if l + 1 < self.layers() || self.relu_out {
                out.iter_mut().for_each(|v| *v = v.max(0.0));
            }
        }
    }

    /// Scores the logits left by [`forward`](Self::forward) against `labels`, and
    /// sets the output gradient to `(softmax - onehot) / divisor`.
    pub fn loss(&self, labels: &[u8], divisor: f32, ws: &mut Workspace) -> Score {
        let classes = self.widths[self.layers()];
        let logits = &ws.outs[self.layers() - 1];
        ws.delta.clear();
        ws.delta.resize(logits.len(), 0.0);
        let mut score = Score::default();
        for ((row, d), &label) in logits
            .chunks_exact(classes)
            .zip(ws.delta.chunks_exact_mut(classes))
            .zip(labels)
        {
            let (best, max) =
                row.iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
                        if v > bv {
                            (i, v)
                        } else {
                            (bi, bv)
                        }
                    });
            let label = label as usize;
            score.correct += usize::from(best == label);
            let mut sum = 0.0f32;
            for (di, &v) in d.iter_mut().zip(row) {
                *di = (v - max).exp();
                sum += *di;
            }
            score.loss += f64::from(sum.ln() - (row[label] - max));
            for di in d.iter_mut() {
                *di /= sum * divisor;
            }
            d[label] -= 1.0 / divisor;
        }
        score
    }

    /// The output of the last [`forward`](Self::forward) in `ws` (`rows` rows).
    pub fn output<'w>(&self, ws: &'w Workspace, rows: usize) -> &'w [f32] {
        &ws.outs[self.layers() - 1][..rows * self.widths[self.layers()]]
    }

    /// Sets the gradient of the output to `grad` (a stage's output gradient
    /// from the next stage), through this stage's closing ReLU.
    pub fn output_grad(&self, grad: &[f32], ws: &mut Workspace) {
        let out = &ws.outs[self.layers() - 1];
        ws.delta.clear();
        ws.delta.extend(
            grad.iter()
                .zip(out)
                .map(|(&g, &o)| if o > 0.0 { g } else { 0.0 }),
        );
    }

    /// Back-propagates the output gradient from [`loss`](Self::loss) or
    /// [`output_grad`](Self::output_grad), adding each parameter's gradient
    /// into `grads` and marking it ready, last layer first; with `grad_in`,
    /// writes the gradient of the input `x` there too.
    ///
    /// Fails with the reducer's error.
    pub fn backward(
        &self,
        params: &[Vec<f32>],
        x: &[f32],
        rows: usize,
        ws: &mut Workspace,
        grads: &mut dyn Gradients,
        grad_in: Option<&mut [f32]>,
    ) -> chorus::Result<()> {
        for l in (0..self.layers()).rev() {
            let (fan_in, fan_out) = (self.widths[l], self.widths[l + 1]);
            let input = if l == 0 { x } else { &ws.outs[l - 1][..] };
            let delta = view(&ws.delta, rows, fan_out);
            let gw = grads.grad_mut(2 * l)?;
            general_mat_mul(
                1.0,
                &view(input, rows, fan_in).t(),
                &delta,
                1.0,
                &mut view_mut(gw, fan_in, fan_out),
            );
            grads.mark_ready(2 * l)?;
            let gb = grads.grad_mut(2 * l + 1)?;
            for row in ws.delta[..rows * fan_out].chunks_exact(fan_out) {
                gb.iter_mut().zip(row).for_each(|(g, d)| *g += d);
            }
            grads.mark_ready(2 * l + 1)?;
            if l > 0 {
                ws.below.clear();
                ws.below.resize(rows * fan_in, 0.0);
                general_mat_mul(
                    1.0,
                    &delta,
                    &view(&params[2 * l], fan_in, fan_out).t(),
                    0.0,
                    &mut view_mut(&mut ws.below, rows, fan_in),
                );
                // ReLU passes the gradient only where its output was positive.
                for (b, &a) in ws.below.iter_mut().zip(input) {
                    if a <= 0.0 {
                        *b = 0.0;
                    }
                }
                std::mem::swap(&mut ws.delta, &mut ws.below);
            }
        }
        if let Some(grad_in) = grad_in {
            // The previous stage's closing ReLU masks this with its own output.
            general_mat_mul(
                1.0,
                &view(&ws.delta, rows, self.widths[1]),
                &view(&params[0], self.widths[0], self.widths[1]).t(),
                0.0,
                &mut view_mut(grad_in, rows, self.widths[0]),
            );
        }
        Ok(())
    }
}

/// SGD with momentum, PyTorch's update: `buf = momentum * buf + grad; param -= lr * buf`.
#[derive(Debug, Clone)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor.
    pub momentum: f32,
    /// One momentum buffer per parameter.
    pub buffers: Vec<Vec<f32>>,
}

impl Sgd {
    /// Zeroed momentum buffers for `params`.
    pub fn new(lr: f32, momentum: f32, params: &[Vec<f32>]) -> Sgd {
        Sgd {
            lr,
            momentum,
            buffers: params.iter().map(|p| vec![0.0; p.len()]).collect(),
        }
    }

    /// Applies the averaged gradients held by `ddp`.
    ///
    /// Fails if a gradient is not available (its bucket is still in flight).
    pub fn step(&mut self, params: &mut [Vec<f32>], ddp: &Ddp<'_>) -> chorus::Result<()> {
        for (i, (p, buf)) in params.iter_mut().zip(&mut self.buffers).enumerate() {
            let g = ddp.grad::<f32>(i)?;
            for ((p, b), &g) in p.iter_mut().zip(buf.iter_mut()).zip(g) {
                *b = self.momentum * *b + g;
                *p -= self.lr * *b;
            }
        }
        Ok(())
    }
}

fn view(data: &[f32], rows: usize, cols: usize) -> ArrayView2<'_, f32> {
    ArrayView2::from_shape((rows, cols), &data[..rows * cols]).expect("a rows x cols slice")
}

fn view_mut(data: &mut [f32], rows: usize, cols: usize) -> ArrayViewMut2<'_, f32> {
    ArrayViewMut2::from_shape((rows, cols), &mut data[..rows * cols]).expect("a rows x cols slice")
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus::ddp::DdpOptions;
    use chorus::{Communicator, Config};

    fn single() -> Communicator {
        let mut config = Config::new(0, 1, "127.0.0.1", 0);
        config.timeout = std::time::Duration::from_secs(10);
        Communicator::new(config).unwrap()
    }

    /// The analytic gradient matches finite differences of the loss.
    #[test]
    fn backward_matches_finite_differences() {
        let mlp = Mlp::new(vec![5, 4, 3]).unwrap();
        let mut params = mlp.init(3);
        let x: Vec<f32> = (0..10).map(|i| (i as f32 * 0.37).sin()).collect();
        let labels = [2u8, 0];
        let comm = single();
        let mut ddp = Ddp::new(&comm, mlp.params(), DdpOptions::default()).unwrap();
        let mut ws = Workspace::default();
        let loss_of = |params: &[Vec<f32>], ws: &mut Workspace| {
            mlp.forward(params, &x, 2, ws);
            mlp.loss(&labels, 2.0, ws).loss / 2.0
        };
        loss_of(&params, &mut ws);
        mlp.backward(&params, &x, 2, &mut ws, &mut ddp, None)
            .unwrap();
        ddp.finish().unwrap();
        let h = 1e-3f32;
        for p in 0..params.len() {
            for j in 0..params[p].len() {
                let analytic = ddp.grad::<f32>(p).unwrap()[j];
                let keep = params[p][j];
                params[p][j] = keep + h;
                let up = loss_of(&params, &mut ws);
                params[p][j] = keep - h;
                let down = loss_of(&params, &mut ws);
                params[p][j] = keep;
                let numeric = ((up - down) / (2.0 * h as f64)) as f32;
                assert!(
                    (analytic - numeric).abs() < 2e-3,
                    "param {p}[{j}]: analytic {analytic}, numeric {numeric}"
                );
            }
        }
    }

    /// Gradients kept in plain vectors.
    struct Plain(Vec<Vec<f32>>);

    impl Gradients for Plain {
        fn grad_mut(&mut self, param: usize) -> chorus::Result<&mut [f32]> {
            Ok(&mut self.0[param])
        }
        fn mark_ready(&mut self, _param: usize) -> chorus::Result<()> {
            Ok(())
        }
    }

    /// Two stages chained by their activations and input gradients give the whole network's
    /// loss and gradients.
    #[test]
    fn stages_chained_match_the_whole_network() {
        let mlp = Mlp::new(vec![6, 5, 4, 3, 3]).unwrap();
        let params = mlp.init(11);
        let x: Vec<f32> = (0..18).map(|i| (i as f32 * 0.53).cos()).collect();
        let labels = [1u8, 0, 2];
        let zeros = |ps: &[Vec<f32>]| Plain(ps.iter().map(|p| vec![0.0; p.len()]).collect());
        let mut ws = Workspace::default();
        mlp.forward(&params, &x, 3, &mut ws);
        let whole = mlp.loss(&labels, 3.0, &mut ws);
        let mut want = zeros(&params);
        mlp.backward(&params, &x, 3, &mut ws, &mut want, None)
            .unwrap();

        let (a, b) = (mlp.stage(0..2), mlp.stage(2..4));
        let (pa, pb) = (
            &params[Mlp::param_range(0..2)],
            &params[Mlp::param_range(2..4)],
        );
        let (mut wa, mut wb) = (Workspace::default(), Workspace::default());
        a.forward(pa, &x, 3, &mut wa);
        let act = a.output(&wa, 3).to_vec();
        b.forward(pb, &act, 3, &mut wb);
        let score = b.loss(&labels, 3.0, &mut wb);
        assert_eq!(score, whole);
        let (mut ga, mut gb) = (zeros(pa), zeros(pb));
        let mut grad_act = vec![0.0; act.len()];
        b.backward(pb, &act, 3, &mut wb, &mut gb, Some(&mut grad_act))
            .unwrap();
        a.output_grad(&grad_act, &mut wa);
        a.backward(pa, &x, 3, &mut wa, &mut ga, None).unwrap();
        let got: Vec<Vec<f32>> = ga.0.into_iter().chain(gb.0).collect();
        for (i, (g, w)) in got.iter().zip(&want.0).enumerate() {
            for (u, v) in g.iter().zip(w) {
                assert!(
                    (u - v).abs() <= 1e-6 * (1.0 + v.abs()),
                    "param {i}: {u} vs {v}"
                );
            }
        }
    }

    #[test]
    fn sgd_follows_pytorchs_momentum_update() {
        let mlp = Mlp::new(vec![1, 1]).unwrap();
        let comm = single();
        let mut ddp = Ddp::new(&comm, mlp.params(), DdpOptions::default()).unwrap();
        let mut params = vec![vec![1.0f32], vec![0.0]];
        let mut sgd = Sgd::new(0.1, 0.9, &params);
        for _ in 0..2 {
            ddp.zero_grad().unwrap();
            ddp.grad_mut::<f32>(0).unwrap()[0] = 1.0;
            ddp.mark_ready(0).unwrap();
            ddp.mark_ready(1).unwrap();
            ddp.finish().unwrap();
            sgd.step(&mut params, &ddp).unwrap();
        }
        // buf: 1, then 1.9; param: 1 - 0.1 - 0.19.
        assert!((params[0][0] - 0.71).abs() < 1e-6, "{}", params[0][0]);
        assert!(Mlp::new(vec![3]).is_err());
    }
}
