"""The process group: torch's calls turned into Chorus calls on tensors' memory."""

import atexit
import datetime
import functools
import os
import queue
import re
import secrets
import socket
import threading
import warnings
import weakref

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, Work, _create_work_from_future

from . import _chorus

_Future = torch._C.Future

# From torch 2.7 on (PyWorkHolder), torch's C++ side (DDP's reducer, functional collectives)
# keeps a Python Work alive for as long as it holds it, so calls can run in the background
# and return such a Work, and the backend registers as a `Backend` under torch's
# ProcessGroup. On older torch, 1.13 included, a Python Work handed to C++ can be freed under
# it: there calls run to completion before they return, and the group is a ProcessGroup
# subclass.
ASYNC = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups()) >= (2, 7)
if ASYNC:
    from torch._C._distributed_c10d import Backend

# Whether this build runs collectives on CUDA tensors' memory (the cargo feature `cuda`), and
# what its calls on them return.
_DevicePending = getattr(_chorus, "DevicePending", ())
_CUDA = _DevicePending != ()

# torch's default process-group timeout, for a group given none.
_DEFAULT_SECONDS = 1800.0

_BOOTSTRAP_KEY = "chorus/bootstrap"
_JOB_ID = "torch"


def _op(opts):
    """torch's `ReduceOp.RedOpType` value of the call's options (SUM without), which Chorus
    maps onto its operator for the tensors' dtype."""
    op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    return int(getattr(op, "op", op))


def _now(opts):
    """Whether the caller waits on the call at once: always before torch 2.7 (see ASYNC), and
    where the options say it is not asynchronous (torch's `async_op=False`). Such a call on
    CPU tensors runs on the calling thread, waking no other."""
    return not ASYNC or not getattr(opts, "asyncOp", True)


def _one(tensors, what):
    """The call's one tensor (Chorus reads its memory, dtype and device)."""
    if len(tensors) != 1:
        raise ValueError(f"chorus {what} takes exactly one tensor per call, got {len(tensors)}")
    return tensors[0]


def _seconds(timeout):
    """torch's timeout as seconds; None for none (torch's zero means none)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return seconds if seconds > 0 else None


def _work(result, finish=None):
    """torch's Work for a finished Chorus call whose outputs are `result`, after `finish` (a
    copy out of staging tensors) has run.

    `wait()` returns at once and `get_future()` holds the outputs. It is torch's own Work
    around a torch Future, so C++ callers such as DDP's reducer never call back into a Python
    object that may be gone by then."""
    if finish is not None:
        finish()
    future = _Future([])  # torch.futures.Future's C++ base: the same future, without its Python __init__
    future.set_result(result)
    return _create_work_from_future(future)


class _Completions:
    """A group's completion thread: completes the futures of its calls in issue order, once
    Chorus's worker has finished each (it never runs a call itself), and runs the callbacks
    chained on them with the GIL, so a slow callback (DDP's hooks) never holds up the next
    call.

    A thread still inside torch's code when the interpreter shuts down is killed there, and
    that aborts the process ("terminate called without an active exception"), so the thread
    finishes what it was handed and ends when its group is shut down (`finish`), and at exit
    for groups never destroyed."""

    def __init__(self, timeout):
        self._timeout = timeout
        self._queue = None
        self._thread = None
        self._lock = threading.Lock()

    def add(self, work):
        with self._lock:
            if self._thread is None:
                self._queue = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, args=(self._queue,), name="chorus-completions",
                                                daemon=True)
                self._thread.start()
                _RUNNING.add(self)
            self._queue.put(work)

    @staticmethod
    def _run(works):
        while (work := works.get()) is not None:
            work._complete()

    def finish(self):
        """Completes the futures handed over so far, then ends the thread (a later call starts
        another). Gives up after the group's timeout: every call ends by then."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._queue.put(None)
        _RUNNING.discard(self)
        thread.join(self._timeout)


# The completion threads running, finished at exit.
_RUNNING = weakref.WeakSet()
atexit.register(lambda: [completions.finish() for completions in list(_RUNNING)])


class _Failed:
    """A failed call's error, as the value of a `_Promise`'s inner future."""

    def __init__(self, error):
        self.error = error


def _unwrap(future):
    value = future.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class _Promise:
    """A torch future for a call's outcome. Its error survives torch's C++ (which knows
    nothing of the Python-level error `torch.futures.Future.set_exception` sets): a callback
    raises it, and torch records that as the future's own error."""

    def __init__(self):
        self._inner = torch.futures.Future()
        self.future = self._inner.then(_unwrap)

    def done(self):
        return self._inner.done()

    def set_result(self, value):
        self._inner.set_result(value)

    def set_exception(self, error):
        self._inner.set_result(_Failed(error))


class _PromisedWork(Work):
    """A Work whose future is completed when its call is done: at once if it is by the time the
    future is asked for, else by the group's completion thread (or by `wait()`, whichever
    comes first; `wait()` raises a failed call's error). Subclasses say how to wait (`_wait`,
    and `_join`, which never runs the call here) and whether the call is done
    (`is_completed`)."""

    def __init__(self, result, completions):
        super().__init__()
        self._result = result
        self._completions = completions
        self._promise = None
        self._lock = threading.Lock()

    def _start(self):
        """Starts the call, if it waits for something to start it."""

    def wait(self, timeout=None):
        try:
            self._wait()
        except (RuntimeError, ValueError) as e:
            self._settle(e)
            raise
        self._settle()
        return True

    def _settle(self, error=None):
        """Completes the future, if one was asked for and is not complete yet."""
        with self._lock:
            promise = self._promise
            if promise is None or promise.done():
                return
            if error is None:
                promise.set_result(self._result)
            else:
                promise.set_exception(error)

    def get_future(self):
        with self._lock:
            if self._promise is not None:
                return self._promise.future
            self._promise = _Promise()
        self._start()
        if self.is_completed():
            self._complete()
        else:
            self._completions.add(self)
        return self._promise.future

    def _complete(self):
        """Waits for the call, then completes the future with its outcome."""
        try:
            self._join()
        except (RuntimeError, ValueError) as e:
            self._settle(e)
        else:
            self._settle()


class _ChorusWork(_PromisedWork):
    """A call running in the background (torch 2.7 and later; see ASYNC).

    `wait()` returns once the call is done and its outputs are in place (running the call on
    the waiting thread if Chorus's worker has not started it), and raises the call's error as
    RuntimeError, every time; `get_future()` completes with the outputs, or the error. The
    tensors stay alive until the call is done, whatever becomes of this object."""

    def __init__(self, pending, result, finish, completions):
        super().__init__(result, completions)
        self._pending = pending
        self._finish = finish

    def _finished(self):
        """Copies the outputs out of staging tensors, once, after the call."""
        with self._lock:
            if self._finish is not None:
                self._finish()
                self._finish = None

    def _wait(self):
        self._pending.wait()
        self._finished()

    def is_completed(self):
        return self._pending.is_completed()

    def _join(self):
        self._pending.join()
        self._finished()


class _DeviceWork(Work):
    """A call on CUDA tensors, enqueued on the device (torch 2.7 and later; see ASYNC), with
    ProcessGroupNCCL's semantics: `wait()` makes torch's current stream wait for the call
    without blocking the host, and raises the call's error if it has failed by then (a later
    failure surfaces at the group's next call or wait, as NCCL's asynchronous errors do);
    `get_future()` is a CUDA-aware future, complete at once, whose value's users are
    ordered after the call; `is_completed()` says whether the call has ended. Chorus holds
    the tensors until it has."""

    def __init__(self, pending, result, finish, side):
        super().__init__()
        self._pending = pending
        self._result = result
        self._finish = finish
        self._device = torch.device("cuda", pending.ordinal)
        self._side = side
        self._copied = None
        self._future = None
        self._lock = threading.Lock()
        for tensor in result:
            if isinstance(tensor, torch.Tensor):
                _IN_FLIGHT[tensor] = pending

    def _order(self, stream):
        """Orders `stream` after the call and its copies out of staging tensors, which run
        once, on the first stream ordered."""
        with self._lock:
            if self._copied is not None:
                stream.wait_event(self._copied)
                return
            self._pending.wait_on(stream.cuda_stream)
            if self._finish is not None:
                with torch.cuda.stream(stream):
                    self._finish()
                self._finish = None
                self._copied = torch.cuda.Event()
                self._copied.record(stream)

    def wait(self, timeout=None):
        self._order(torch.cuda.current_stream(self._device))
        return True

    def is_completed(self):
        return self._pending.is_completed()

    def get_future(self):
        with self._lock:
            future = self._future
        if future is None:
            side = self._side(self._device)
            self._order(side)
            future = torch.futures.Future(devices=[self._device])
            with torch.cuda.stream(side):
                future.set_result(self._result)
            with self._lock:
                self._future = self._future or future
        return self._future


# Device calls in flight by output tensor, for `_patch_work`: torch's handle on a Work says
# it is completed once its future is, and a device call's future is complete at once.
_IN_FLIGHT = weakref.WeakKeyDictionary()


class _ReceivedWork(Work):
    """The finished Work of a receive from any source, which also tells the sender:
    `dist.recv` without `src` waits on it, then asks `_source_rank()`.

    torch's future-wrapping Work (see `_work`) cannot say who sent, so this one is a Python
    Work. The torch 1.13 trap `_work` avoids (a C++ waiter holding a Python Work whose Python
    object is gone) does not arise: on torch 1.13 and 2.x alike, `dist.recv` and `dist.irecv`
    call `recv_anysource` from Python and use its result there. Its future holds the
    received tensors and the sender's rank (see `_patch_work`)."""

    def __init__(self, tensors, source):
        super().__init__()
        self._tensors = tensors
        self._source = source

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def _source_rank(self):
        return self._source

    # torch's older, deprecated name for it.
    source_rank = _source_rank

    def get_future(self):
        future = torch.futures.Future()
        future.set_result((self._tensors, _SENDER, self._source))
        return future


# The mark of a receive's future that carries its sender (see `_patch_work`).
_SENDER = "chorus:sender"


def _patch_work():
    """Lets torch's handle on a Python Work answer `is_completed()` and `_source_rank()`.

    A Work a Python backend returns reaches the caller through torch's ProcessGroup as torch's
    own handle, which passes `wait()` and `get_future()` on to the Python object but answers
    `is_completed()` and `_source_rank()` from C++ state the Python object cannot set. The
    handle's methods are wrapped here to ask the future when torch's own answer is no: done
    when the call is, and, for a receive from any source, carrying the sender. Works of other
    backends answer as before."""
    if getattr(Work, "_chorus_patched", False):
        return
    completed, source_rank = Work.is_completed, Work._source_rank

    def future_of(work):
        try:
            return work.get_future()
        except RuntimeError:  # a Work without a future
            return None

    def is_completed(self):
        if completed(self):
            return True
        future = future_of(self)
        if future is None or not future.done():
            return False
        try:
            value = future.value()
        except RuntimeError:  # a failed call's future
            return True
        # A device call's future is complete once the call is enqueued; the call, once
        # every call on its outputs has ended.
        outputs = value if isinstance(value, list) else []
        return all(_IN_FLIGHT.get(t) is None or _IN_FLIGHT[t].is_completed()
                   for t in outputs if isinstance(t, torch.Tensor))

    def _source_rank(self):
        future = future_of(self)
        if future is not None and future.done():
            try:
                value = future.value()
            except RuntimeError:  # a failed call's future
                value = None
            if isinstance(value, tuple) and len(value) == 3 and value[1] == _SENDER:
                return value[2]
        return source_rank(self)

    Work.is_completed = is_completed
    Work._source_rank = _source_rank
    Work.source_rank = _source_rank
    Work._chorus_patched = True


def _staged(tensor):
    """`tensor` if contiguous, else a contiguous copy; and whether a copy was made."""
    if tensor.is_contiguous():
        return tensor, False
    return tensor.contiguous(), True


def _stream(tensor):
    """torch's current stream on a CUDA tensor's device, as its raw handle: where Chorus
    orders a call on the tensor (0 for other tensors, whose calls no stream orders)."""
    return torch.cuda.current_stream(tensor.device).cuda_stream if tensor.is_cuda else 0


def _bytes(tensor):
    """A contiguous tensor's bytes, as a flat uint8 tensor (bool's too)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten_into(flat, tensors):
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def _host_address():
    """The address other hosts reach this one by (CHORUS_SOCKET_ADDR, else the route to
    MASTER_ADDR, else this host name's address)."""
    given = os.environ.get("CHORUS_SOCKET_ADDR")
    if given:
        return given
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, int(os.environ.get("MASTER_PORT", "1") or 1)))
                return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _local_shape(rank, size):
    """This rank's place on its host: torchrun's LOCAL_* for the whole job, else unknown."""
    try:
        if int(os.environ.get("WORLD_SIZE", "-1")) == size:
            return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        pass
    return 0, 1


def _connect(store, rank, size, timeout):
    """A Chorus communicator for this group; rank 0 hosts its rendezvous store on a free port
    and tells the others where, and the job's secret, through torch's store."""
    seconds = _seconds(timeout) or 0.0
    local_rank, local_size = _local_shape(rank, size)
    host = None
    if size == 1:
        address, port, token = "127.0.0.1", 0, secrets.token_hex(16)
    elif rank == 0:
        token = secrets.token_hex(16)
        host = _chorus.StoreHost(_JOB_ID, token)
        address, port = _host_address(), host.port
        store.set(_BOOTSTRAP_KEY, f"{address} {port} {token}")
    else:
        address, port, token = store.get(_BOOTSTRAP_KEY).decode().split(" ")
        port = int(port)
    return _chorus.Comm(rank, size, address, port, _JOB_ID, token, seconds, local_rank, local_size, host)


class _Batch:
    """Point-to-point calls posted and not yet started. They start together, as one Chorus
    group (every send and receive posted before any is waited for), when one of their Works
    is waited on or before the group's next other call: torch's `isend`/`irecv` and
    `batch_isend_irecv` then cannot wait on each other, even with large messages both ways.
    Chorus holds the tensors until the batch is done."""

    def __init__(self, comm):
        self._comm = comm
        self._ops = []
        self._copies = []
        # The stream current when the first call on CUDA tensors was posted, which the batch
        # is ordered on, and the points it must follow on the streams current at the others.
        self._stream = None
        self._posted = []
        self._pending = None
        self._error = None
        self._lock = threading.Lock()
        self.ran = False

    def add(self, is_send, tensor, peer, tag):
        staged, copied = _staged(tensor)
        self._ops.append((is_send, staged, peer, tag))
        if copied and not is_send:
            self._copies.append((tensor, staged))
        if staged.is_cuda:
            current = torch.cuda.current_stream(staged.device)
            if self._stream is None:
                self._stream = current
            elif current != self._stream:
                posted = torch.cuda.Event()
                posted.record(current)
                self._posted.append(posted)

    def start(self):
        """Starts the batch once, after the work queued on each call's stream before it was
        posted; memory Chorus refuses is an error its every wait raises."""
        if not self.ran:
            self.ran = True
            try:
                stream = 0
                if self._stream is not None:
                    for posted in self._posted:
                        self._stream.wait_event(posted)
                    stream = self._stream.cuda_stream
                self._pending = self._comm.exchange(self._ops, stream)
            except (RuntimeError, ValueError) as e:
                self._error = e
            self._ops = None

    def wait(self, join=False):
        """Starts the batch if it has not started and waits for it (with `join`, leaving it to
        Chorus's worker); raises its failure, on this and every later call."""
        self.start()
        if self._error is not None:
            raise self._error
        if join:
            self._pending.join()
        else:
            self._pending.wait()
        with self._lock:
            for tensor, staged in self._copies:
                tensor.copy_(staged)
            self._copies = []

    def is_completed(self):
        self.start()
        return self._error is not None or self._pending.is_completed()

    def copies_back(self):
        """Whether a receive lands in a tensor through a contiguous stand-in, whose copy back
        runs on the caller's stream."""
        return bool(self._copies)


class _PointToPointWork(_PromisedWork):
    """The Work of a send or receive in a `_Batch`: waiting on it, or asking for its future,
    starts the batch.

    Like `_ReceivedWork`, a Python Work: torch's `send`, `recv`, `isend`, `irecv` and
    `batch_isend_irecv` hand it to Python callers only, never to a C++ waiter."""

    def __init__(self, batch, tensors, completions):
        super().__init__(tensors, completions)
        self._batch = batch

    def _wait(self):
        self._batch.wait()

    def is_completed(self):
        return self._batch.is_completed()

    def _start(self):
        self._batch.start()
        if self._batch.copies_back():
            # Copies back run on the caller's stream: here, not on the completion thread
            # (which then hands the outcome, or the error, to the future).
            try:
                self._batch.wait()
            except (RuntimeError, ValueError):
                pass

    def _join(self):
        self._batch.wait(join=True)


class _Calls:
    """torch's process-group calls on Chorus: what the group (torch before 2.7) and the
    backend (torch 2.7 and later) share. Each starts one Chorus call and returns its Work."""

    def _setup(self, store, timeout, comm=None, space="chorus/monitored"):
        self._store = store
        self._timeout = timeout
        self._comm = comm if comm is not None else _connect(store, self.rank(), self.size(), timeout)
        # Where monitored_barrier keeps its keys in torch's store.
        self._space = space
        self._barriers = 0
        self._batch = None
        self._side = None
        self._completions = _Completions(_seconds(timeout) or _DEFAULT_SECONDS)

    def shutdown(self):
        """Called by `destroy_process_group` (torch 2.x): the futures of the group's calls are
        completed, and their callbacks run, before it returns."""
        self._completions.finish()

    def getBackendName(self):
        return "chorus"

    def name(self):
        return "chorus"

    def _get_backend_name(self):
        return "chorus"

    # -- helpers ---------------------------------------------------------------------------

    def _call(self, kind, inp, out, result, finish=None, op=0, root=0, counts=None, opts=None):
        """torch's Work for Chorus's collective `kind` from the contiguous tensor `inp` into
        `out`, whose outputs are `result` once `finish` (a copy out of staging tensors) has
        run. Chorus decides where it runs: the host collectives for CPU tensors; for CUDA
        tensors the device ones, or the host ones through copies, ordered on torch's current
        stream. `opts`, the call's options, say whether the caller waits on it at once."""
        now = _now(opts)
        pending = self._comm.call(kind, inp, out, op, root, _stream(inp), counts, now)
        return self._issue(pending, result, finish, now)

    def _issue(self, pending, result, finish=None, now=False):
        """torch's Work for the started Chorus call `pending` whose outputs are `result`, once
        `finish` (a copy out of staging tensors) has run after it.

        Where torch allows it (see ASYNC) the call runs in the background, and a call on CUDA
        tensors is ordered on torch's streams as NCCL's are; elsewhere, and for a call on CPU
        tensors waited on at once (`now`: it ran on this thread), it has ended before this
        returns."""
        if not ASYNC or (now and not isinstance(pending, _DevicePending)):
            pending.wait()
            return _work(result, finish)
        if isinstance(pending, _DevicePending):
            return _DeviceWork(pending, result, finish, self._side_stream)
        return _ChorusWork(pending, result, finish, self._completions)

    def _together(self, works, result):
        """One Work for `works`, issued in order: done when the last is, each one's outputs
        then in place."""
        if not all(isinstance(w, _ChorusWork) for w in works):
            for w in works:
                w.wait()
            return _work(result)

        def finish():
            for w in works:
                w._finished()

        return _ChorusWork(works[-1]._pending, result, finish, self._completions)

    def _side_stream(self, device):
        """A stream of torch's on `device` on which device calls' futures are completed, each
        ordered after its call (Chorus's completion side, as torch sees it)."""
        if self._side is None or self._side.device != device:
            self._side = torch.cuda.Stream(device)
        return self._side

    def _root(self, root, what):
        if not 0 <= root < self.size():
            raise ValueError(f"chorus {what}: root {root} is not a rank of this group of {self.size()}")
        return root

    def _peer(self, peer, what):
        if not 0 <= peer < self.size():
            raise ValueError(f"chorus {what}: peer {peer} is not a rank of this group of {self.size()}")
        return peer

    # -- collectives -----------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        tensor = _one(tensors, "allreduce")
        staged, copied = _staged(tensor)
        return self._call("all_reduce", staged, staged, tensors, (lambda: tensor.copy_(staged)) if copied else None,
                          op=_op(opts), opts=opts)

    def allreduce_coalesced(self, tensors, opts=None):
        if not tensors:
            raise ValueError("chorus allreduce_coalesced needs at least one tensor")
        for t in tensors:
            if t.dtype != tensors[0].dtype or t.device != tensors[0].device:
                raise ValueError("chorus allreduce_coalesced needs tensors of one dtype on one device")
        flat = _flat(tensors)
        return self._call("all_reduce", flat, flat, tensors, lambda: _unflatten_into(flat, tensors), op=_op(opts),
                          opts=opts)

    def broadcast(self, tensors, opts=None):
        tensor = _one(tensors, "broadcast")
        root = self._root(opts.rootRank if opts is not None else 0, "broadcast")
        staged, copied = _staged(tensor)
        return self._call("broadcast", staged, staged, tensors, (lambda: tensor.copy_(staged)) if copied else None,
                          root=root, opts=opts)

    def reduce(self, tensors, opts=None):
        tensor = _one(tensors, "reduce")
        root = self._root(opts.rootRank if opts is not None else 0, "reduce")
        staged, copied = _staged(tensor)
        return self._call("reduce", staged, staged, tensors, (lambda: tensor.copy_(staged)) if copied else None,
                          op=_op(opts), root=root, opts=opts)

    def _all_gather_flat(self, output, tensor, result, finish, opts):
        if output.numel() * output.element_size() != tensor.numel() * tensor.element_size() * self.size():
            raise ValueError(
                f"chorus allgather: the output holds {output.numel()} elements, "
                f"not world size {self.size()} x {tensor.numel()}")
        return self._call("all_gather", _staged(tensor)[0], output, result, finish, opts=opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        tensor = _one(input_tensors, "allgather")
        outputs = _one_list(output_tensors, self.size(), tensor, "allgather")
        flat = torch.empty(self.size() * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        return self._all_gather_flat(flat, tensor, output_tensors, lambda: _unflatten_into(flat, outputs), opts)

    def _allgather_base(self, output, input, opts=None):
        _same_dtype(output, input, "all_gather_into_tensor")
        staged, copied = _staged(output)
        return self._all_gather_flat(staged, input, [output], (lambda: output.copy_(staged)) if copied else None,
                                     opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """Every rank's `input_list` into `output_lists[rank]`, as one all-gather of their
        bytes."""
        size = self.size()
        if len(output_lists) != size or any(len(outs) != len(input_list) for outs in output_lists):
            raise ValueError(f"chorus allgather_coalesced needs {size} output lists (the group's size) "
                             f"of {len(input_list)} tensors each (one per input tensor)")
        for outs in output_lists:
            for out, t in zip(outs, input_list):
                _same_dtype(out, t, "allgather_coalesced")
                if out.numel() != t.numel() or out.device != t.device:
                    raise ValueError(f"chorus allgather_coalesced: an output of {out.numel()} elements on "
                                     f"{out.device} for an input of {t.numel()} on {t.device}")
        if not input_list:
            return self.barrier(opts)
        flat = _flat([_bytes(t) for t in input_list])
        gathered = torch.empty(size * flat.numel(), dtype=torch.uint8, device=flat.device)

        def finish():
            for outs, block in zip(output_lists, gathered.chunk(size)):
                offset = 0
                for out in outs:
                    n = out.numel() * out.element_size()
                    out.copy_(block[offset:offset + n].clone().view(out.dtype).view_as(out))
                    offset += n

        return self._all_gather_flat(gathered, flat, output_lists, finish, opts)

    def _reduce_scatter_flat(self, output, flat, result, opts):
        if flat.numel() != output.numel() * self.size():
            raise ValueError(
                f"chorus reduce_scatter: the input holds {flat.numel()} elements, "
                f"not world size {self.size()} x {output.numel()}")
        staged, copied = _staged(output)
        return self._call("reduce_scatter", flat, staged, result, (lambda: output.copy_(staged)) if copied else None,
                          op=_op(opts), opts=opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        output = _one(output_tensors, "reduce_scatter")
        inputs = _one_list(input_tensors, self.size(), output, "reduce_scatter")
        return self._reduce_scatter_flat(output, _flat(inputs), output_tensors, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        _same_dtype(output, input, "reduce_scatter_tensor")
        return self._reduce_scatter_flat(output, _staged(input)[0], [output], opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        _same_dtype(output, input, "all_to_all_single")
        size = self.size()
        send = _counts(input, input_split_sizes, size, "input")
        recv = _counts(output, output_split_sizes, size, "output")
        counts = None
        if send is not None or recv is not None:
            counts = (send or [input.numel() // size] * size, recv or [output.numel() // size] * size)
        staged, copied = _staged(output)
        return self._call("all_to_all", _staged(input)[0], staged, [output],
                          (lambda: output.copy_(staged)) if copied else None, counts=counts, opts=opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        size = self.size()
        if len(output_tensors) != size or len(input_tensors) != size:
            raise ValueError(f"chorus alltoall needs {size} input and {size} output tensors")
        for t in list(output_tensors) + list(input_tensors):
            _same_dtype(t, input_tensors[0], "alltoall")
        flat_in = _flat(input_tensors)
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=flat_in.dtype,
                               device=output_tensors[0].device)
        counts = ([t.numel() for t in input_tensors], [t.numel() for t in output_tensors])
        return self._call("all_to_all", flat_in, flat_out, output_tensors,
                          lambda: _unflatten_into(flat_out, output_tensors), counts=counts, opts=opts)

    def gather(self, output_tensors, input_tensors, opts=None):
        tensor = _one(input_tensors, "gather")
        root = self._root(opts.rootRank if opts is not None else 0, "gather")
        if self.rank() == root:
            outputs = _one_list(output_tensors, self.size(), tensor, "gather")
            flat = torch.empty(self.size() * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
            finish = lambda: _unflatten_into(flat, outputs)  # noqa: E731
        else:
            if output_tensors and any(len(o) for o in output_tensors):
                raise ValueError(f"chorus gather: only the root (rank {root}) passes output tensors")
            flat, finish = torch.empty(0, dtype=tensor.dtype, device=tensor.device), None
        return self._call("gather", _staged(tensor)[0], flat, output_tensors, finish, root=root, opts=opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        output = _one(output_tensors, "scatter")
        root = self._root(opts.rootRank if opts is not None else 0, "scatter")
        if self.rank() == root:
            flat = _flat(_one_list(input_tensors, self.size(), output, "scatter"))
        else:
            if input_tensors and any(len(i) for i in input_tensors):
                raise ValueError(f"chorus scatter: only the root (rank {root}) passes input tensors")
            flat = torch.empty(0, dtype=output.dtype, device=output.device)
        staged, copied = _staged(output)
        return self._call("scatter", flat, staged, output_tensors, (lambda: output.copy_(staged)) if copied else None,
                          root=root, opts=opts)

    def barrier(self, opts=None):
        now = _now(opts)
        return self._issue(self._comm.barrier(now), [], now=now)

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        """A barrier through torch's store that names the ranks that did not arrive in time
        (all of them with `wait_all_ranks`, else the first), as Gloo's does."""
        timeout = getattr(opts, "timeout", opts) if opts is not None else self._timeout
        seconds = _seconds(timeout) or _seconds(self._timeout) or _DEFAULT_SECONDS
        n = self._barriers
        self._barriers += 1
        key = lambda what, r: f"{self._space}/{n}/{what}/{r}"  # noqa: E731
        rank, size = self.rank(), self.size()
        if rank != 0:
            self._store.set(key("arrived", rank), b"1")
            try:
                self._store.wait([key("released", 0)], datetime.timedelta(seconds=seconds))
            except RuntimeError as e:
                raise RuntimeError(f"chorus monitored_barrier: rank 0 did not release rank {rank} within {seconds} s ({e})") from None
            self._comm.barrier().wait()
            return _work([])
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=seconds)
        missing = []
        for r in range(1, size):
            left = max((deadline - datetime.datetime.now()).total_seconds(), 0.001)
            try:
                self._store.wait([key("arrived", r)], datetime.timedelta(seconds=left))
            except RuntimeError:
                missing.append(r)
                if not wait_all_ranks:
                    break
        if missing:
            which = ", ".join(str(r) for r in missing)
            raise RuntimeError(f"chorus monitored_barrier: rank{'s' if len(missing) > 1 else ''} {which} did not arrive within {seconds} s")
        self._store.set(key("released", 0), b"1")
        self._comm.barrier().wait()
        return _work([])

    def gather_single(self, output, tensor, opts=None):
        """`gather` into one tensor of world-size blocks on the root (torch 2.x's
        gather_into_tensor)."""
        root = self._root(opts.rootRank if opts is not None else 0, "gather")
        if self.rank() == root:
            _same_dtype(output, tensor, "gather")
            if output.numel() != self.size() * tensor.numel():
                raise ValueError(f"chorus gather: the output holds {output.numel()} elements, "
                                 f"not world size {self.size()} x {tensor.numel()}")
            staged, copied = _staged(output)
        else:
            staged, copied = torch.empty(0, dtype=tensor.dtype, device=tensor.device), False
        return self._call("gather", _staged(tensor)[0], staged, [output],
                          (lambda: output.copy_(staged)) if copied else None, root=root, opts=opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self._allgather_base(output, tensor, opts) for output, tensor in zip(outputs, inputs)]
        return self._together(works, outputs) if works else self.barrier(opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self._reduce_scatter_base(output, tensor, opts) for output, tensor in zip(outputs, inputs)]
        return self._together(works, outputs) if works else self.barrier(opts)

    # torch 2.x's names for the single-tensor forms.
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_to_all_single = alltoall_base
    gather_into_tensor = gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- point to point --------------------------------------------------------------------

    def send(self, tensors, dst, tag):
        return self._post(True, tensors, self._peer(dst, "send"), tag, "send")

    def recv(self, tensors, src, tag):
        return self._post(False, tensors, self._peer(src, "recv"), tag, "recv")

    def _post(self, is_send, tensors, peer, tag, what):
        tensor = _one(tensors, what)
        if self._batch is None or self._batch.ran:
            self._batch = _Batch(self._comm)
        self._batch.add(is_send, tensor, peer, tag)
        return _PointToPointWork(self._batch, tensors, self._completions)

    def _start_batch(self):
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.start()

    def recv_anysource(self, tensors, tag):
        """A receive from whichever rank sends this one a message with `tag` first; the Work
        returned names that rank (torch's `recv` and `irecv` without `src`)."""
        tensor = _one(tensors, "recv")
        staged, copied = _staged(tensor)
        source = self._comm.recv_any(staged, tag, _stream(staged))
        if copied:
            tensor.copy_(staged)
        return _ReceivedWork(tensors, source)


class ProcessGroupChorus(_Calls, ProcessGroup):
    """A torch.distributed process group whose operations run on Chorus (torch before 2.7:
    see ASYNC)."""

    def __init__(self, store, rank, size, timeout):
        ProcessGroup.__init__(self, rank, size)
        self._setup(store, timeout)

    def _get_backend(self, device=None):
        """The backend serving `device`'s tensors: this group itself (torch 2.x's
        `batch_isend_irecv` asks it whether it coalesces; it does not, so torch posts the
        calls one by one and `_Batch` runs them together)."""
        return self


if ASYNC:

    class BackendChorus(_Calls, Backend):
        """The torch.distributed backend whose operations run on Chorus in the background,
        registered under torch's ProcessGroup as Gloo's and NCCL's are (torch 2.7 and later:
        see ASYNC)."""

        def __init__(self, store, rank, size, timeout, comm=None, space="chorus/monitored"):
            Backend.__init__(self, rank, size)
            self._setup(store, timeout, comm, space)

        # torch reads these as attributes of a Python backend (its C++ base would call back
        # into Python for them, and recurse).
        @property
        def supports_coalescing(self):
            return False

        @property
        def supports_splitting(self):
            return False

        @property
        def supports_shrinking(self):
            return True

        def shrink(self, ranks_to_exclude, shrink_flags=0, opts=None):
            """A backend of this one's ranks less the dead and `ranks_to_exclude`
            (`torch.distributed.shrink_group`): every surviving rank calls it, and they agree
            on who is left over their own connections, so rank 0 may be among the dead. With
            torch's SHRINK_ABORT the calls still in flight here fail first."""
            if shrink_flags == getattr(dist.distributed_c10d, "SHRINK_ABORT", None):
                self._comm.abort()
            comm = self._comm.shrink(list(ranks_to_exclude))
            return BackendChorus(self._store, comm.rank, comm.size, self._timeout, comm, f"{self._space}/shrunk")

    _patch_work()


def _patch_shrink():
    """Registers the group `torch.distributed.shrink_group` makes around a shrunk Chorus
    backend as `init_process_group` registers Chorus's: a custom backend, for every device it
    serves. torch (2.15) registers any shrunk backend as Gloo's (NCCL's on a GPU), and its C++
    side then takes Chorus's backend for Gloo's: DDP's logger, made on the new group, would
    read it as one and crash."""
    c10d = dist.distributed_c10d
    create = getattr(c10d, "_create_shrunk_process_group", None)
    if create is None or getattr(create, "_chorus_patched", False):
        return

    @functools.wraps(create)
    def create_registered(new_backend, remaining_ranks, metadata, *args, **kwargs):
        if isinstance(new_backend, BackendChorus) and not _reachable(metadata["store"]):
            # torch's store died with the rank that hosted it (rank 0, under env://), and torch
            # would wait its whole timeout to clone it: the new group gets a store of its own
            # process instead. Chorus needs none; what needs torch's store across ranks
            # (new_group, monitored_barrier) fails on the shrunk group.
            warnings.warn("chorus shrink: torch's store is gone with the rank that hosted it; the shrunk "
                          "group's store is local to this process (new_group and monitored_barrier need a "
                          "store that outlives every rank)")
            metadata = dict(metadata, store=dist.HashStore())
        group = create(new_backend, remaining_ranks, metadata, *args, **kwargs)
        if isinstance(new_backend, BackendChorus):
            custom = ProcessGroup.BackendType.CUSTOM
            for device in ("cpu", "cuda") if _CUDA else ("cpu",):
                group._register_backend(torch.device(device), custom, new_backend)
            group._set_default_backend(custom)
        return group

    create_registered._chorus_patched = True
    c10d._create_shrunk_process_group = create_registered


if ASYNC:
    _patch_shrink()


def _reachable(store):
    """Whether torch's `store` still answers (a store whose server died fails at once)."""
    try:
        store.check(["chorus/alive"])
        return True
    except RuntimeError:  # torch's DistNetworkError and DistStoreError are RuntimeErrors
        return False


def _after_batch(method):
    """`method`, called once the point-to-point calls posted before it have started."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self._batch is not None:
            self._start_batch()
        return method(self, *args, **kwargs)

    return run


# Every call but the point-to-point ones first starts the batch they posted, so calls run in
# the order they were made.
for _name, _method in list(vars(_Calls).items()):
    if callable(_method) and (not _name.startswith("_") or _name in ("_allgather_base", "_reduce_scatter_base")) \
            and _name not in ("getBackendName", "name", "send", "recv"):
        setattr(_Calls, _name, _after_batch(_method))


def _one_list(lists, size, like, what):
    if len(lists) != 1 or len(lists[0]) != size:
        raise ValueError(f"chorus {what} needs one list of {size} tensors (the group's size)")
    for t in lists[0]:
        if t.device != like.device:
            raise ValueError(f"chorus {what}: tensors on {like.device} and {t.device} cannot be mixed in one call")
        _same_dtype(t, like, what)
        if t.numel() != like.numel():
            raise ValueError(f"chorus {what}: every tensor in the list must hold {like.numel()} elements, one holds {t.numel()}")
    return lists[0]


def _same_dtype(a, b, what):
    if a.dtype != b.dtype:
        raise TypeError(f"chorus {what}: tensors of {a.dtype} and {b.dtype} cannot be mixed")


def _counts(tensor, splits, size, which):
    """Elements per peer for all_to_all_single's split sizes (rows of dim 0); None for equal blocks."""
    if not splits:
        if tensor.numel() % size:
            raise ValueError(f"chorus all_to_all_single: the {which} ({tensor.numel()} elements) does not split into {size} equal blocks")
        return None
    if len(splits) != size:
        raise ValueError(f"chorus all_to_all_single: {len(splits)} {which} split sizes for a group of {size}")
    rows = tensor.shape[0] if tensor.dim() else 1
    if sum(splits) != rows:
        raise ValueError(f"chorus all_to_all_single: {which} split sizes add up to {sum(splits)}, not the {rows} rows of dim 0")
    row = tensor.numel() // rows if rows else 0
    return [s * row for s in splits]


def failure(group=None):
    """The `ChorusError` that broke `group`'s communicator (the default group's without one),
    not raised; None while it works. Its `culprit` is the rank to leave out of
    `torch.distributed.shrink_group`, whichever call the failure surfaced in (DDP's, say)."""
    group = group if group is not None else dist.group.WORLD
    backend = group._get_backend(torch.device("cpu")) if ASYNC else group
    comm = getattr(backend, "_comm", None)
    if comm is None:
        raise ValueError(f"group {group} does not run on chorus")
    return comm.failure()


def create_process_group(store, rank, size, timeout):
    """The backend's creator, as torch.distributed.Backend.register_backend calls it: a
    `BackendChorus` where torch runs calls in the background (see ASYNC), else a
    `ProcessGroupChorus`."""
    if ASYNC:
        return BackendChorus(store, rank, size, timeout)
    return ProcessGroupChorus(store, rank, size, timeout)
