//! `train --device cuda` (feature `cuda`): the MLP's steps on the GPU.
//!
//! Parameters, gradients, momentum and activations live in device memory; parameters,
//! gradients and momentum each in one flat buffer, in [`Mlp::params`] order. The matrix
//! products go through cuBLAS, the element-wise work (bias and ReLU, the loss and its
//! gradient, bias gradients, the SGD update) through a small CUDA C module NVRTC compiles
//! when the trainer starts. One [`CudaCommunicator::all_reduce`] per step averages the flat
//! gradient buffer over the ranks: a single DDP bucket in device memory. The arithmetic is
//! the host trainer's ([`Mlp`], [`Sgd`]) without fused multiply-adds, so the two agree up
//! to the rounding of the matrix products and of `exp`/`log`.

use std::ffi::CString;
use std::path::PathBuf;
use std::sync::Arc;

use chorus::cuda::{CudaCommunicator, CudaError, CudaSlice, CudaStream, Device};
use chorus::{Communicator, ReduceOp};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaFunction, DevicePtr, DevicePtrMut, DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, Ptx};

use super::mlp::{Mlp, Score, Sgd};

/// The element-wise kernels, one thread per element (per row for the loss, per column for
/// the bias gradient).
const SOURCE: &str = r#"
extern "C" __global__ void bias_act(float *out, const float *bias, int rows, int cols, int relu) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    float v = out[i] + bias[i % cols];
    out[i] = relu && v < 0.0f ? 0.0f : v;
}

extern "C" __global__ void softmax_xent(const float *logits, const unsigned char *labels,
                                        int rows, int classes, float divisor, float *delta,
                                        float *scores) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float *row = logits + r * classes;
    float *d = delta + r * classes;
    int best = 0;
    float max = __int_as_float(0xff800000);
    for (int i = 0; i < classes; i++) {
        if (row[i] > max) { best = i; max = row[i]; }
    }
    float sum = 0.0f;
    for (int i = 0; i < classes; i++) {
        d[i] = expf(row[i] - max);
        sum += d[i];
    }
    int label = labels[r];
    scores[r] = logf(sum) - (row[label] - max);
    scores[rows + r] = best == label ? 1.0f : 0.0f;
    for (int i = 0; i < classes; i++) d[i] /= sum * divisor;
    d[label] -= 1.0f / divisor;
}

extern "C" __global__ void col_sum(const float *delta, int rows, int cols, float *out) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float s = out[c];
    for (int r = 0; r < rows; r++) s += delta[r * cols + c];
    out[c] = s;
}

extern "C" __global__ void relu_back(float *below, const float *input, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && input[i] <= 0.0f) below[i] = 0.0f;
}

extern "C" __global__ void sgd(float *param, float *buf, const float *grad, float lr,
                               float momentum, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float b = momentum * buf[i] + grad[i];
    buf[i] = b;
    param[i] -= lr * b;
}
"#;

/// Threads per block of the element-wise kernels.
const BLOCK: u32 = 256;

/// The compiled [`SOURCE`].
struct Kernels {
    bias_act: CudaFunction,
    softmax_xent: CudaFunction,
    col_sum: CudaFunction,
    relu_back: CudaFunction,
    sgd: CudaFunction,
}

/// Per-batch device buffers, sized for `rows` samples.
struct Batch {
    rows: usize,
    /// Pixels and labels.
    x: CudaSlice<f32>,
    labels: CudaSlice<u8>,
    /// Every layer's output (after ReLU except the last).
    outs: Vec<CudaSlice<f32>>,
    /// Gradient with respect to the current layer's output, and the one below it.
    delta: CudaSlice<f32>,
    below: CudaSlice<f32>,
    /// Per-sample losses, then per-sample 1.0 (correct) or 0.0.
    scores: CudaSlice<f32>,
}

/// One rank's GPU: its device communicator, cuBLAS handle, kernels and the MLP's state.
pub struct Gpu {
    comm: CudaCommunicator,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Kernels,
    widths: Vec<usize>,
    /// Where each parameter starts in the flat buffers, then their total length.
    offsets: Vec<usize>,
    lr: f32,
    momentum: f32,
    params: CudaSlice<f32>,
    grads: CudaSlice<f32>,
    buffers: CudaSlice<f32>,
    batch: Batch,
}

/// A row-major product `c = op(a) · op(b) + beta · c`, `op(a)` `m x k` and `op(b)` `k x n`;
/// `ta` (`tb`) says `a` (`b`) is stored transposed.
#[derive(Debug, Clone, Copy)]
struct Product {
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    beta: f32,
}

fn driver(e: DriverError) -> String {
    format!("--device cuda: {e}")
}

fn cuda(e: CudaError) -> String {
    format!("--device cuda: {e}")
}

impl Gpu {
    /// Opens GPU `LOCAL_RANK % count` and uploads `params` and `sgd`'s momentum for `mlp`.
    ///
    /// Collective: every rank of `comm` calls it, and all fail if one cannot use its GPU.
    pub fn new(
        comm: &Communicator,
        mlp: &Mlp,
        params: &[Vec<f32>],
        sgd: &Sgd,
    ) -> Result<Gpu, String> {
        let local = open(comm);
        let mut failed = [u64::from(local.is_err())];
        comm.all_reduce(&mut failed, ReduceOp::Max)
            .map_err(|e| e.to_string())?;
        let device = match local {
            Ok(_) if failed[0] != 0 => {
                return Err("--device cuda: another rank could not set up its GPU".into())
            }
            other => other?,
        };
        let comm = CudaCommunicator::new(comm, device).map_err(|e| e.to_string())?;
        let stream = comm.device().new_stream().map_err(cuda)?;
        let blas =
            CudaBlas::new(stream.clone()).map_err(|e| format!("--device cuda: cuBLAS: {e}"))?;
        let kernels = Kernels::load(&stream)?;
        let offsets: Vec<usize> = std::iter::once(0)
            .chain(params.iter().scan(0, |end, p| {
                *end += p.len();
                Some(*end)
            }))
            .collect();
        let flat = |v: &[Vec<f32>]| stream.clone_htod(&v.concat()).map_err(driver);
        let (params, buffers) = (flat(params)?, flat(&sgd.buffers)?);
        let grads = stream.alloc_zeros(params.len()).map_err(driver)?;
        let batch = Batch::new(&stream, mlp.widths(), 1)?;
        Ok(Gpu {
            comm,
            stream,
            blas,
            kernels,
            widths: mlp.widths().to_vec(),
            offsets,
            lr: sgd.lr,
            momentum: sgd.momentum,
            params,
            grads,
            buffers,
            batch,
        })
    }

    /// The GPU's name and the all-reduce's path, for the banner.
    pub fn describe(&self) -> String {
        crate::perf::gpu::describe(&self.comm)
    }

    /// Zeroes the gradients (before a step's first micro-batch).
    pub fn zero_grad(&mut self) -> Result<(), String> {
        self.stream.memset_zeros(&mut self.grads).map_err(driver)
    }

    /// Runs `labels.len()` samples `x` forward and backward, adding their gradients (of the
    /// loss summed over the samples and divided by `divisor`) to this rank's; their score.
    pub fn forward_backward(
        &mut self,
        x: &[f32],
        labels: &[u8],
        divisor: f32,
    ) -> Result<Score, String> {
        let rows = labels.len();
        if rows > self.batch.rows {
            self.batch = Batch::new(&self.stream, &self.widths, rows)?;
        }
        let b = &mut self.batch;
        self.stream
            .memcpy_htod(x, &mut b.x.slice_mut(..x.len()))
            .map_err(driver)?;
        self.stream
            .memcpy_htod(labels, &mut b.labels.slice_mut(..rows))
            .map_err(driver)?;
        self.forward(rows)?;
        self.loss(rows, divisor)?;
        self.backward(rows)?;
        let mut scores = vec![0.0f32; 2 * rows];
        let b = &self.batch;
        self.stream
            .memcpy_dtoh(&b.scores.slice(..2 * rows), &mut scores)
            .map_err(driver)?;
        self.stream.synchronize().map_err(driver)?;
        Ok(Score {
            loss: scores[..rows].iter().map(|&l| f64::from(l)).sum(),
            correct: scores[rows..].iter().filter(|&&c| c != 0.0).count(),
        })
    }

    /// Averages the gradients over the ranks and applies the SGD update.
    pub fn step(&mut self) -> Result<(), String> {
        self.comm
            .all_reduce(&mut self.grads, ReduceOp::Avg, &self.stream)
            .map_err(|e| e.to_string())?;
        let n = self.params.len();
        let (lr, momentum, count) = (self.lr, self.momentum, n as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.sgd);
        launch
            .arg(&mut self.params)
            .arg(&mut self.buffers)
            .arg(&self.grads);
        launch.arg(&lr).arg(&momentum).arg(&count);
        // SAFETY: `sgd(param, buf, grad, lr, momentum, n)` reads and writes `n` elements of
        // the three flat buffers, which all hold `n`.
        unsafe { launch.launch(threads(n)) }.map_err(driver)?;
        Ok(())
    }

    /// This rank's gradients, one vector per parameter.
    pub fn gradients(&self) -> Result<Vec<Vec<f32>>, String> {
        self.download(&self.grads)
    }

    /// The parameters, one vector each.
    pub fn params(&self) -> Result<Vec<Vec<f32>>, String> {
        self.download(&self.params)
    }

    /// The momentum buffers, one vector per parameter.
    pub fn momentum(&self) -> Result<Vec<Vec<f32>>, String> {
        self.download(&self.buffers)
    }

    fn download(&self, flat: &CudaSlice<f32>) -> Result<Vec<Vec<f32>>, String> {
        let all = self.stream.clone_dtoh(flat).map_err(driver)?;
        self.stream.synchronize().map_err(driver)?;
        Ok(self
            .offsets
            .windows(2)
            .map(|w| all[w[0]..w[1]].to_vec())
            .collect())
    }

    fn layers(&self) -> usize {
        self.widths.len() - 1
    }

    fn forward(&mut self, rows: usize) -> Result<(), String> {
        let layers = self.layers();
        for l in 0..layers {
            let (fan_in, fan_out) = (self.widths[l], self.widths[l + 1]);
            let (w, bias) = (self.offsets[2 * l], self.offsets[2 * l + 1]);
            let b = &mut self.batch;
            let (done, rest) = b.outs.split_at_mut(l);
            let out = &mut rest[0];
            let input = if l == 0 { &b.x } else { &done[l - 1] };
            let product = Product {
                m: rows,
                n: fan_out,
                k: fan_in,
                ta: false,
                tb: false,
                beta: 0.0,
            };
            matmul(&self.blas, product, input, &self.params.slice(w..bias), out)?;
            let bias = self.params.slice(bias..self.offsets[2 * l + 2]);
            let relu = i32::from(l + 1 < layers);
            let (r, c) = (rows as i32, fan_out as i32);
            let mut launch = self.stream.launch_builder(&self.kernels.bias_act);
            launch.arg(out).arg(&bias).arg(&r).arg(&c).arg(&relu);
            // SAFETY: `bias_act(out, bias, rows, cols, relu)` touches `rows * cols` elements
            // of `out` (sized for `batch.rows >= rows` samples) and `cols` of `bias`.
            unsafe { launch.launch(threads(rows * fan_out)) }.map_err(driver)?;
        }
        Ok(())
    }

    /// The per-sample scores and the output gradient, `(softmax - onehot) / divisor`.
    fn loss(&mut self, rows: usize, divisor: f32) -> Result<(), String> {
        let classes = self.widths[self.layers()] as i32;
        let b = &mut self.batch;
        let r = rows as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.softmax_xent);
        launch
            .arg(&b.outs[b.outs.len() - 1])
            .arg(&b.labels)
            .arg(&r)
            .arg(&classes);
        launch.arg(&divisor).arg(&mut b.delta).arg(&mut b.scores);
        // SAFETY: `softmax_xent` reads `rows * classes` logits and `rows` labels, writes
        // `rows * classes` of `delta` and `2 * rows` scores: all sized for `batch.rows`.
        unsafe { launch.launch(threads(rows)) }.map_err(driver)?;
        Ok(())
    }

    /// Back-propagates the output gradient, adding each parameter's gradient into `grads`.
    fn backward(&mut self, rows: usize) -> Result<(), String> {
        for l in (0..self.layers()).rev() {
            let (fan_in, fan_out) = (self.widths[l], self.widths[l + 1]);
            let (w, bias, end) = (
                self.offsets[2 * l],
                self.offsets[2 * l + 1],
                self.offsets[2 * l + 2],
            );
            let b = &mut self.batch;
            let input = if l == 0 { &b.x } else { &b.outs[l - 1] };
            let weight_grad = Product {
                m: fan_in,
                n: fan_out,
                k: rows,
                ta: true,
                tb: false,
                beta: 1.0,
            };
            let mut gw = self.grads.slice_mut(w..bias);
            matmul(&self.blas, weight_grad, input, &b.delta, &mut gw)?;
            let mut gb = self.grads.slice_mut(bias..end);
            let (r, c) = (rows as i32, fan_out as i32);
            let mut launch = self.stream.launch_builder(&self.kernels.col_sum);
            launch.arg(&b.delta).arg(&r).arg(&c).arg(&mut gb);
            // SAFETY: `col_sum(delta, rows, cols, out)` reads `rows * cols` of `delta` and
            // adds into the `cols` elements of the bias gradient.
            unsafe { launch.launch(threads(fan_out)) }.map_err(driver)?;
            if l > 0 {
                let below = Product {
                    m: rows,
                    n: fan_in,
                    k: fan_out,
                    ta: false,
                    tb: true,
                    beta: 0.0,
                };
                let weight = self.params.slice(w..bias);
                matmul(&self.blas, below, &b.delta, &weight, &mut b.below)?;
                let n = rows * fan_in;
                let count = n as i32;
                let mut launch = self.stream.launch_builder(&self.kernels.relu_back);
                launch.arg(&mut b.below).arg(input).arg(&count);
                // SAFETY: `relu_back(below, input, n)` touches `n` elements of each, both
                // sized for `batch.rows` samples of width `fan_in`.
                unsafe { launch.launch(threads(n)) }.map_err(driver)?;
                std::mem::swap(&mut b.delta, &mut b.below);
            }
        }
        Ok(())
    }
}

impl Kernels {
    /// [`SOURCE`] compiled to PTX, without fused multiply-adds.
    fn compile() -> Result<Ptx, String> {
        let options = CompileOptions {
            fmad: Some(false),
            ..CompileOptions::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(SOURCE, options)
            .map_err(|e| format!("--device cuda: compiling the trainer's kernels: {e}"))
    }

    /// Compiles [`SOURCE`] and loads it on `stream`'s device.
    fn load(stream: &Arc<CudaStream>) -> Result<Kernels, String> {
        let module = stream
            .context()
            .load_module(Self::compile()?)
            .map_err(driver)?;
        let f = |name: &str| module.load_function(name).map_err(driver);
        Ok(Kernels {
            bias_act: f("bias_act")?,
            softmax_xent: f("softmax_xent")?,
            col_sum: f("col_sum")?,
            relu_back: f("relu_back")?,
            sgd: f("sgd")?,
        })
    }
}

impl Batch {
    /// Buffers for `rows` samples through layers of `widths`.
    fn new(stream: &Arc<CudaStream>, widths: &[usize], rows: usize) -> Result<Batch, String> {
        let alloc = |n: usize| stream.alloc_zeros::<f32>(n).map_err(driver);
        let widest = widths.iter().copied().max().unwrap_or(1);
        Ok(Batch {
            rows,
            x: alloc(rows * widths[0])?,
            labels: stream.alloc_zeros::<u8>(rows).map_err(driver)?,
            outs: widths[1..]
                .iter()
                .map(|&w| alloc(rows * w))
                .collect::<Result<_, _>>()?,
            delta: alloc(rows * widest)?,
            below: alloc(rows * widest)?,
            scores: alloc(2 * rows)?,
        })
    }
}

/// Launch shape for `n` threads (at least one block).
fn threads(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(BLOCK).max(1), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `p` through cuBLAS, whose matrices are column-major: a row-major matrix is its transpose,
/// so it computes `cᵀ = op(b)ᵀ · op(a)ᵀ`.
fn matmul<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
    blas: &CudaBlas,
    p: Product,
    a: &A,
    b: &B,
    c: &mut C,
) -> Result<(), String> {
    if a.len() < p.m * p.k || b.len() < p.k * p.n || c.len() < p.m * p.n {
        return Err(format!("--device cuda: a {p:?} on buffers too short"));
    }
    // SAFETY: the buffers hold at least the `m x k`, `k x n` and `m x n` elements the
    // leading dimensions of `gemm_config` make cuBLAS touch (checked above).
    unsafe { blas.gemm(gemm_config(p), b, a, c) }
        .map_err(|e| format!("--device cuda: cuBLAS sgemm: {e}"))
}

/// cuBLAS's description of `p`, with `b` as its first operand and `a` as its second.
fn gemm_config(p: Product) -> GemmConfig<f32> {
    let op = |t| match t {
        true => cublasOperation_t::CUBLAS_OP_T,
        false => cublasOperation_t::CUBLAS_OP_N,
    };
    GemmConfig {
        transa: op(p.tb),
        transb: op(p.ta),
        m: p.n as i32,
        n: p.m as i32,
        k: p.k as i32,
        alpha: 1.0,
        lda: if p.tb { p.k } else { p.n } as i32,
        ldb: if p.ta { p.m } else { p.k } as i32,
        beta: p.beta,
        ldc: p.n as i32,
    }
}

/// This rank's GPU, `LOCAL_RANK % count`, with the all-reduce's kernels loaded (which also
/// makes NVRTC loadable) and cuBLAS found.
fn open(comm: &Communicator) -> Result<Device, String> {
    let device = crate::perf::gpu::local_device(comm, 0, 1)?;
    device.load_kernels().map_err(cuda)?;
    find_cublas()?;
    Ok(device)
}

/// Makes sure cuBLAS can be opened: on the loader's path, else from the lib folder of the
/// CUDA toolkit in `$CUDA_HOME`, `$CUDA_PATH` or `/usr/local/cuda`, loaded for the rest of
/// the process (cuBLASLt first, which cuBLAS needs) so that cudarc finds it by name.
fn find_cublas() -> Result<(), String> {
    // SAFETY: only tries to open the library under its usual names.
    let present = || unsafe { cudarc::cublas::sys::is_culib_present() };
    if present() {
        return Ok(());
    }
    let dirs: Vec<PathBuf> = [chorus::env::CUDA_HOME, chorus::env::CUDA_PATH]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .chain([PathBuf::from("/usr/local/cuda")])
        .map(|root| root.join("lib64"))
        .collect();
    for dir in &dirs {
        for version in ["13", "12"] {
            let libs = [
                dir.join(format!("libcublasLt.so.{version}")),
                dir.join(format!("libcublas.so.{version}")),
            ];
            if libs.iter().all(|l| l.is_file()) {
                libs.iter().for_each(|l| open_forever(l));
                if present() {
                    return Ok(());
                }
            }
        }
    }
    Err(format!(
        "--device cuda: no cuBLAS library found (libcublas.so.13 or .12 on the loader path, or in {}): \
         install the CUDA toolkit's cuBLAS or add its lib folder to LD_LIBRARY_PATH",
        dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
    ))
}

/// Loads the shared library at `path` and keeps it loaded.
fn open_forever(path: &std::path::Path) {
    let Ok(path) = CString::new(path.as_os_str().as_encoded_bytes()) else {
        return;
    };
    // SAFETY: loads one of NVIDIA's cuBLAS libraries, whose initialisers have no
    // preconditions; the handle is never closed.
    unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// BLAS's `sgemm` on column-major host matrices, as cuBLAS defines it.
    fn sgemm(g: GemmConfig<f32>, a: &[f32], b: &[f32], c: &mut [f32]) {
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let (lda, ldb, ldc) = (g.lda as usize, g.ldb as usize, g.ldc as usize);
        let n_op = cublasOperation_t::CUBLAS_OP_N;
        let op_a = |i: usize, l: usize| match g.transa == n_op {
            true => a[i + l * lda],
            false => a[l + i * lda],
        };
        let op_b = |l: usize, j: usize| match g.transb == n_op {
            true => b[l + j * ldb],
            false => b[j + l * ldb],
        };
        for i in 0..m {
            for j in 0..n {
                let dot: f32 = (0..k).map(|l| op_a(i, l) * op_b(l, j)).sum();
                c[i + j * ldc] = g.alpha * dot + g.beta * c[i + j * ldc];
            }
        }
    }

    /// A layer's three products (forward, weight gradient, gradient below) described to
    /// cuBLAS give the row-major products.
    #[test]
    fn gemm_config_computes_row_major_products() {
        let (rows, fan_in, fan_out) = (5, 4, 3);
        let cases = [
            (rows, fan_out, fan_in, false, false, 0.0),
            (fan_in, fan_out, rows, true, false, 1.0),
            (rows, fan_in, fan_out, false, true, 0.0),
        ];
        for (m, n, k, ta, tb, beta) in cases {
            let p = Product {
                m,
                n,
                k,
                ta,
                tb,
                beta,
            };
            let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.7).sin()).collect();
            let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 1.3).cos()).collect();
            let c0: Vec<f32> = (0..m * n).map(|i| i as f32 * 0.1).collect();
            // Row-major: `a` is m x k (stored k x m when `ta`), `b` k x n (n x k when `tb`).
            let at = |i: usize, l: usize| if ta { a[l * m + i] } else { a[i * k + l] };
            let bt = |l: usize, j: usize| if tb { b[j * k + l] } else { b[l * n + j] };
            let mut c = c0.clone();
            sgemm(gemm_config(p), &b, &a, &mut c);
            for i in 0..m {
                for j in 0..n {
                    let dot: f32 = (0..k).map(|l| at(i, l) * bt(l, j)).sum();
                    let want = dot + beta * c0[i * n + j];
                    let got = c[i * n + j];
                    assert!(
                        (got - want).abs() < 1e-5,
                        "{p:?} [{i}][{j}]: {got} != {want}"
                    );
                }
            }
        }
    }

    /// NVRTC compiles the kernels (no GPU needed; skipped where NVRTC is not on the
    /// loader path).
    #[test]
    fn kernels_compile() {
        // SAFETY: only tries to open the library under its usual names.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            use std::io::Write as _;
            let line = "skipping: no NVRTC library on the loader path (kernels_compile)\n";
            let _ = std::io::stderr().write_all(line.as_bytes());
            return;
        }
        Kernels::compile().unwrap();
    }
}
