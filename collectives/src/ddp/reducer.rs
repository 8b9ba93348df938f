//! [`Ddp`]: gradients in buckets, each all-reduced as soon as backward has filled it.

use std::ops::Range;

use super::bucket::{assign, caps_in_bytes, Flat, ParamSpec};
use super::fingerprint;
use super::hook::Compression;
use crate::{env, Communicator, DType, Element, Error, ReduceOp, Result, Work};

/// How [`Ddp`] buckets and reduces gradients.
#[derive(Debug, Clone, PartialEq)]
pub struct DdpOptions {
    /// Bucket size in MiB (PyTorch's `bucket_cap_mb`, default 25).
    pub bucket_cap_mb: f64,
    /// Size of each dtype's first bucket in MiB (default 1, as in PyTorch), so
    /// the first all-reduce starts early in backward.
    pub first_bucket_cap_mb: f64,
    /// Treat parameters never marked ready in a step as having zero gradient,
    /// instead of failing [`Ddp::finish`].
    pub find_unused_parameters: bool,
    /// Cast `f32` gradients to 16 bits for the all-reduce.
    pub compression: Compression,
    /// Start each bucket's all-reduce as soon as it is ready (default), or
    /// all of them in [`Ddp::finish`] (`CHORUS_DDP_OVERLAP=0`, for comparison).
    pub overlap: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_mb: 25.0,
            first_bucket_cap_mb: 1.0,
            find_unused_parameters: false,
            compression: Compression::None,
            overlap: true,
        }
    }
}

impl DdpOptions {
    /// The defaults, with `overlap` from `CHORUS_DDP_OVERLAP` (`0` turns it off).
    ///
    /// Fails if the variable is set to something other than `0` or `1`.
    pub fn from_env() -> Result<DdpOptions> {
        let overlap = match std::env::var(env::CHORUS_DDP_OVERLAP).ok().as_deref() {
            None | Some("1") => true,
            Some("0") => false,
            Some(other) => {
                return Err(Error::Config {
                    var: env::CHORUS_DDP_OVERLAP,
                    value: other.to_string(),
                    reason: "must be 0 or 1".into(),
                })
            }
        };
        Ok(DdpOptions {
            overlap,
            ..DdpOptions::default()
        })
    }
}

/// Where a parameter's gradient lives.
#[derive(Debug)]
struct Slot {
    spec: ParamSpec,
    bucket: usize,
    range: Range<usize>,
    /// Marked ready in the current micro-step.
    ready: bool,
    /// Marked ready in some micro-step since the last synchronised step.
    used: bool,
}

/// A bucket's buffer: here, or away being all-reduced.
#[derive(Debug)]
enum State {
    Here(Flat),
    /// The buffer itself is being all-reduced.
    Away(Work<Flat>),
    /// A 16-bit copy is being all-reduced; the buffer stays here.
    Compressed(Flat, Work<Flat>),
    /// Only while a transition is in progress, or after a failed wait.
    Lost,
}

#[derive(Debug)]
struct Bucket {
    state: State,
    members: Vec<usize>,
    /// Members not yet ready in this micro-step.
    waiting: usize,
}

/// Data-parallel gradient reduction over flat buffers, like PyTorch's DDP reducer.
///
/// Parameters are registered once, in the order the model uses them; their
/// gradients live inside buckets (gradient-as-bucket-view: no copy). In
/// backward, write a parameter's gradient through [`grad_mut`](Self::grad_mut)
/// and call [`mark_ready`](Self::mark_ready): when a bucket's last gradient
/// is ready, its all-reduce starts on the communicator's worker thread while
/// backward goes on. [`finish`](Self::finish) waits for all of them and
/// leaves every gradient averaged over the ranks. Buckets are launched in
/// the same order on every rank whatever order their gradients arrive in.
/// Buckets come from [`Communicator::alloc_shared`], so on one host their
/// all-reduces go through shared memory directly.
///
/// ```no_run
/// use chorus::ddp::{Ddp, DdpOptions, ParamSpec};
/// use chorus::{Communicator, DType};
///
/// let comm = Communicator::from_env()?;
/// let specs = vec![ParamSpec::new("w", 1000, DType::F32), ParamSpec::new("b", 10, DType::F32)];
/// let mut ddp = Ddp::new(&comm, specs, DdpOptions::default())?;
/// let (mut w, mut b) = (vec![0.5f32; 1000], vec![0.0f32; 10]);
/// ddp.broadcast_parameters(&mut [&mut w[..], &mut b[..]])?;
/// ddp.zero_grad()?;
/// ddp.grad_mut::<f32>(1)?.fill(0.1); // backward produces the last parameter's gradient first
/// ddp.mark_ready(1)?;
/// ddp.grad_mut::<f32>(0)?.fill(0.2);
/// ddp.mark_ready(0)?;
/// ddp.finish()?; // gradients are now averaged over the ranks
/// # Ok::<(), chorus::Error>(())
/// ```
#[derive(Debug)]
pub struct Ddp<'c> {
    comm: &'c Communicator,
    options: DdpOptions,
    slots: Vec<Slot>,
    buckets: Vec<Bucket>,
    /// The next bucket to launch: buckets start in index order only.
    next: usize,
    /// False inside [`Ddp::no_sync`].
    sync: bool,
}

impl<'c> Ddp<'c> {
    /// Registers `params` (in the order the model uses them) and builds the buckets.
    ///
    /// A collective: every rank must call it with the same list, which is
    /// checked. Fails naming the first parameter that differs between ranks,
    /// or a parameter whose type is not a float type, or bad bucket caps.
    pub fn new(
        comm: &'c Communicator,
        params: Vec<ParamSpec>,
        options: DdpOptions,
    ) -> Result<Self> {
        if let Some(p) = params.iter().find(|p| !p.dtype.is_float()) {
            return Err(Error::InvalidArgument(format!(
                "parameter {p}: gradients must be of a float type"
            )));
        }
        let (first_cap, cap) = caps_in_bytes(options.first_bucket_cap_mb, options.bucket_cap_mb)?;
        fingerprint::check(comm, &params)?;
        let groups = assign(&params, first_cap, cap);
        let mut slots = Vec::with_capacity(params.len());
        let mut buckets = Vec::with_capacity(groups.len());
        let mut place = vec![(0, 0..0); params.len()];
        for (b, members) in groups.iter().enumerate() {
            let mut len = 0;
            for &i in members {
                place[i] = (b, len..len + params[i].len);
                len += params[i].len;
            }
            buckets.push(Bucket {
                state: State::Here(Flat::shared(comm, params[members[0]].dtype, len)?),
                members: members.clone(),
                waiting: members.len(),
            });
        }
        for (spec, (bucket, range)) in params.into_iter().zip(place) {
            slots.push(Slot {
                spec,
                bucket,
                range,
                ready: false,
                used: false,
            });
        }
        tracing::info!(
            params = slots.len(),
            buckets = buckets.len(),
            overlap = options.overlap,
            compression = ?options.compression,
            "ddp ready"
        );
        Ok(Ddp {
            comm,
            options,
            slots,
            buckets,
            next: 0,
            sync: true,
        })
    }

    /// The communicator gradients are reduced over.
    pub fn communicator(&self) -> &'c Communicator {
        self.comm
    }

    /// The registered parameters, in registration order.
    pub fn params(&self) -> impl Iterator<Item = &ParamSpec> {
        self.slots.iter().map(|s| &s.spec)
    }

    /// The buckets, in launch order, each as the parameter indices it holds (in layout order).
    pub fn buckets(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.members.clone()).collect()
    }

    fn slot(&self, param: usize) -> Result<&Slot> {
        self.slots.get(param).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "no parameter #{param}: {} are registered",
                self.slots.len()
            ))
        })
    }

    /// Parameter `param`'s gradient (a view into its bucket).
    ///
    /// Fails if there is no such parameter, `T` is not its type, or its
    /// bucket is being all-reduced (call [`finish`](Self::finish) first).
    pub fn grad<T: Element>(&self, param: usize) -> Result<&[T]> {
        let slot = self.slot(param)?;
        check_type::<T>(&slot.spec)?;
        match &self.buckets[slot.bucket].state {
            State::Here(flat) | State::Compressed(flat, _) => Ok(&flat.typed()[slot.range.clone()]),
            _ => Err(in_flight(&slot.spec)),
        }
    }

    /// Parameter `param`'s gradient, to write in backward (a view into its bucket).
    ///
    /// Fails as [`grad`](Self::grad) does, or if the bucket's compressed copy is in flight.
    pub fn grad_mut<T: Element>(&mut self, param: usize) -> Result<&mut [T]> {
        let slot = self.slot(param)?;
        check_type::<T>(&slot.spec)?;
        let (bucket, range) = (slot.bucket, slot.range.clone());
        match &mut self.buckets[bucket].state {
            State::Here(flat) => Ok(&mut flat.typed_mut()[range]),
            _ => Err(in_flight(&self.slots[param].spec)),
        }
    }

    /// Sets every gradient to zero (before a new round of accumulation).
    ///
    /// Fails if a bucket is being all-reduced.
    pub fn zero_grad(&mut self) -> Result<()> {
        for b in &mut self.buckets {
            match &mut b.state {
                State::Here(flat) => flat.clear(),
                _ => return Err(in_flight(&self.slots[b.members[0]].spec)),
            }
        }
        Ok(())
    }

    /// Says that backward has finished writing `param`'s gradient.
    ///
    /// When this completes a bucket (and all buckets before it have
    /// started), its all-reduce starts now, asynchronously; inside
    /// [`no_sync`](Self::no_sync) nothing is sent. Fails if there is no such
    /// parameter or it was already marked ready in this step.
    pub fn mark_ready(&mut self, param: usize) -> Result<()> {
        let slot = self.slot(param)?;
        if slot.ready {
            return Err(Error::InvalidArgument(format!(
                "parameter {} was marked ready twice in one step",
                slot.spec
            )));
        }
        let bucket = slot.bucket;
        let slot = &mut self.slots[param];
        slot.ready = true;
        slot.used = true;
        self.buckets[bucket].waiting -= 1;
        if self.sync && self.options.overlap {
            self.launch_ready()?;
        }
        Ok(())
    }

    /// Starts the all-reduce of every ready bucket, in index order, up to the first unready one.
    fn launch_ready(&mut self) -> Result<()> {
        while self.next < self.buckets.len() && self.buckets[self.next].waiting == 0 {
            self.launch(self.next)?;
            self.next += 1;
        }
        Ok(())
    }

    fn launch(&mut self, b: usize) -> Result<()> {
        let world = self.comm.world_size();
        let bucket = &mut self.buckets[b];
        let State::Here(mut flat) = std::mem::replace(&mut bucket.state, State::Lost) else {
            return Err(Error::InvalidArgument(format!(
                "bucket {b} was launched twice in one step"
            )));
        };
        bucket.state = match self.options.compression.wire(flat.dtype()) {
            Some(wire) => {
                let sent = Compression::compress(&mut flat, wire, world);
                let work = all_reduce_async(self.comm, sent, ReduceOp::Sum);
                State::Compressed(flat, work)
            }
            None => State::Away(all_reduce_async(self.comm, flat, ReduceOp::Avg)),
        };
        Ok(())
    }

    /// Ends a step: waits for every bucket's all-reduce; gradients are then averaged over the ranks.
    ///
    /// Inside [`no_sync`](Self::no_sync) it only ends the micro-step (the
    /// gradients stay local and keep accumulating). Fails naming the
    /// parameters never marked ready since the last synchronised step
    /// (unless [`DdpOptions::find_unused_parameters`], which treats their
    /// gradients as zero), or with the communicator's error.
    pub fn finish(&mut self) -> Result<()> {
        if !self.sync {
            self.reset(false);
            return Ok(());
        }
        let unused: Vec<usize> = (0..self.slots.len())
            .filter(|&i| !self.slots[i].used)
            .collect();
        if !unused.is_empty() && !self.options.find_unused_parameters {
            let names: Vec<String> = unused
                .iter()
                .map(|&i| self.slots[i].spec.name.clone())
                .collect();
            // Buckets already launched are in flight on every rank: let them land.
            let waited = self.wait_all();
            self.reset(true);
            waited?;
            return Err(Error::InvalidArgument(format!(
                "parameters never marked ready in this step: {} (set find_unused_parameters to treat them as zero)",
                names.join(", ")
            )));
        }
        for i in unused {
            let slot = &self.slots[i];
            if let State::Here(flat) = &mut self.buckets[slot.bucket].state {
                flat.clear_range(slot.range.clone());
            }
        }
        // Parameters ready in an earlier micro-step only complete their buckets now.
        for b in &mut self.buckets {
            b.waiting = 0;
        }
        let launched = self.launch_ready();
        let waited = self.wait_all();
        self.reset(true);
        launched.and(waited)
    }

    /// Waits for every bucket in flight, keeping the first error.
    fn wait_all(&mut self) -> Result<()> {
        let mut result = Ok(());
        for bucket in &mut self.buckets {
            bucket.state = match std::mem::replace(&mut bucket.state, State::Lost) {
                State::Away(work) => match work.wait() {
                    Ok(flat) => State::Here(flat),
                    Err(e) => {
                        result = result.and(Err(e));
                        State::Lost
                    }
                },
                State::Compressed(mut flat, work) => {
                    match work.wait() {
                        Ok(wire) => Compression::decompress(&wire, &mut flat),
                        Err(e) => result = result.and(Err(e)),
                    }
                    State::Here(flat)
                }
                other => other,
            };
        }
        result
    }

    /// Forgets this micro-step's ready marks (and, after a synchronised step, which parameters were used).
    fn reset(&mut self, synced: bool) {
        for slot in &mut self.slots {
            slot.ready = false;
            slot.used &= !synced;
        }
        for b in &mut self.buckets {
            b.waiting = b.members.len();
        }
        self.next = 0;
    }

    /// Runs `micro_step` with synchronisation off: gradients accumulate locally,
    /// and the next synchronised [`finish`](Self::finish) all-reduces the sum.
    pub fn no_sync<R>(&mut self, micro_step: impl FnOnce(&mut Self) -> R) -> R {
        let was = std::mem::replace(&mut self.sync, false);
        let r = micro_step(self);
        self.sync = was;
        r
    }

    /// Copies rank 0's parameters to every rank (call once before training).
    ///
    /// `params` are the registered parameters' values, in registration
    /// order, all of type `T`. A collective. Fails if their number, lengths
    /// or type differ from the registration.
    pub fn broadcast_parameters<T: Element>(&self, params: &mut [&mut [T]]) -> Result<()> {
        if params.len() != self.slots.len() {
            return Err(Error::InvalidArgument(format!(
                "broadcast_parameters: {} buffers given for {} registered parameters",
                params.len(),
                self.slots.len()
            )));
        }
        for (p, slot) in params.iter().zip(&self.slots) {
            check_type::<T>(&slot.spec)?;
            if p.len() != slot.spec.len {
                return Err(Error::InvalidArgument(format!(
                    "broadcast_parameters: parameter {} given {} elements",
                    slot.spec,
                    p.len()
                )));
            }
        }
        let mut packed: Vec<T> = params.iter().flat_map(|p| p.iter().copied()).collect();
        self.comm.broadcast(&mut packed, 0)?;
        let mut rest = &packed[..];
        for p in params.iter_mut() {
            let (head, tail) = rest.split_at(p.len());
            p.copy_from_slice(head);
            rest = tail;
        }
        Ok(())
    }
}

/// Starts the all-reduce of a flat buffer of any dtype.
fn all_reduce_async(comm: &Communicator, flat: Flat, op: ReduceOp) -> Work<Flat> {
    fn typed<T: Element>(comm: &Communicator, flat: Flat, op: ReduceOp) -> Work<Flat> {
        comm.all_reduce_async::<T, Flat>(flat, op)
    }
    let dtype: DType = flat.dtype();
    crate::with_dtype!(dtype, typed, comm, flat, op)
}

fn check_type<T: Element>(spec: &ParamSpec) -> Result<()> {
    if T::DTYPE != spec.dtype {
        return Err(Error::InvalidArgument(format!(
            "parameter {spec} accessed as {}",
            T::DTYPE
        )));
    }
    Ok(())
}

fn in_flight(spec: &ParamSpec) -> Error {
    Error::InvalidArgument(format!(
        "the gradient of {spec} is being all-reduced: call finish() first"
    ))
}
