"""CUDA tensors through the chorus backend: every collective that takes them, on both device
paths, against the same call's result computed on the CPU; DDP on the GPU; the refusals.

Where there is no GPU (or the extension was built without CUDA) each test skips, saying why;
with CHORUS_REQUIRE_CUDA=1 it fails instead."""

import os
import secrets

import pytest
import torch
import torch.distributed as dist

import chorus_torch._backend as backend
from harness import failures, run


def _need_cuda():
    missing = None
    if not backend._CUDA:
        missing = "chorus_torch was built without the cargo feature cuda"
    elif not torch.cuda.is_available():
        missing = "torch sees no CUDA GPU"
    if missing is None:
        return
    if os.environ.get("CHORUS_REQUIRE_CUDA") == "1":
        pytest.fail(f"CHORUS_REQUIRE_CUDA=1 but {missing}")
    pytest.skip(f"no CUDA tensors to test: {missing}")


def _device(rank):
    return torch.device("cuda", rank % torch.cuda.device_count())


def _inputs(seed, rank, world, n, dtype):
    """Every rank's input of `n` elements (the same on every rank for a given seed), drawn at
    random: small integers, so that sums are exact in every dtype."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(-8, 9, (world, n), generator=g)
    if dtype == torch.bool:
        return ints > 0
    if not dtype.is_floating_point and not dtype.is_signed:
        ints = ints.abs()
    return ints.to(dtype)


def _check(got, want, what):
    got = got.cpu()
    if want.dtype.is_floating_point:
        ok = torch.allclose(got.double(), want.double(), rtol=1e-2 if want.element_size() == 2 else 1e-6, atol=1e-6)
    else:
        ok = torch.equal(got, want)
    assert ok, f"{what}: got {got[:8].tolist()}..., want {want[:8].tolist()}..."


def collectives(rank, world, seed):
    device = _device(rank)
    checked = []
    for dtype, n in ((torch.float32, 1000), (torch.bfloat16, 77), (torch.int64, 3), (torch.bool, 9),
                     (torch.float32, 5 << 20)):
        everyone = _inputs(seed + n, rank, world, n, dtype)
        mine = everyone[rank]
        what = f"{dtype}, {n} elements"
        ops = [(dist.ReduceOp.MAX, lambda x: x.max(0).values)]
        if dtype != torch.bool:
            ops.append((dist.ReduceOp.SUM, lambda x: x.sum(0, dtype=x.dtype)))
        if dtype.is_floating_point:
            ops.append((dist.ReduceOp.AVG, lambda x: x.double().mean(0)))
        for op, reduce in ops:
            t = mine.to(device)
            dist.all_reduce(t, op=op)
            _check(t, reduce(everyone), f"all_reduce {op} {what}")
        t = mine.to(device)
        dist.broadcast(t, src=world - 1)
        _check(t, everyone[world - 1], f"broadcast {what}")
        t = mine.to(device)
        dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
        _check(t, everyone.max(0).values if rank == 0 else mine, f"reduce {what}")
        out = torch.empty(world * n, dtype=dtype, device=device)
        dist.all_gather_into_tensor(out, mine.to(device))
        _check(out, everyone.reshape(-1), f"all_gather_into_tensor {what}")
        # NCCL's in-place layout: the input is this rank's block of the output.
        out = torch.zeros(world * n, dtype=dtype, device=device)
        out[rank * n:(rank + 1) * n] = mine.to(device)
        dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n])
        _check(out, everyone.reshape(-1), f"in-place all_gather_into_tensor {what}")
        outs = [torch.empty(n, dtype=dtype, device=device) for _ in range(world)]
        dist.all_gather(outs, mine.to(device))
        _check(torch.cat(outs), everyone.reshape(-1), f"all_gather {what}")
        checked.append(what)
    # reduce_scatter: every rank holds world blocks; rank q gets the sum of block q.
    n = 1 << 16
    blocks = _inputs(seed, rank, world, world * n, torch.float32).reshape(world, world, n)
    want = blocks.sum(0)[rank]
    out = torch.empty(n, device=device)
    dist.reduce_scatter_tensor(out, blocks[rank].reshape(-1).to(device))
    _check(out, want, "reduce_scatter_tensor")
    whole = blocks[rank].reshape(-1).to(device)
    dist.reduce_scatter_tensor(whole[rank * n:(rank + 1) * n], whole)
    _check(whole[rank * n:(rank + 1) * n], want, "in-place reduce_scatter_tensor")
    out = torch.empty(n, device=device)
    dist.reduce_scatter(out, [b.to(device) for b in blocks[rank]])
    _check(out, want, "reduce_scatter")
    # A non-contiguous tensor, and all_reduce_coalesced-style DDP buckets.
    everyone = _inputs(seed + 1, rank, world, 64, torch.float32).reshape(world, 8, 8)
    t = everyone[rank].to(device).t()
    dist.all_reduce(t)
    _check(t, everyone.sum(0).t(), "all_reduce of a transposed tensor")
    # The call waits for torch's work queued before it on the current stream.
    big = torch.ones(1 << 22, device=device)
    torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time queued ahead
    big.mul_(rank + 1)
    dist.all_reduce(big)
    _check(big[:1000], torch.full((1000,), float(world * (world + 1) // 2)), "all_reduce after queued work")
    # Asynchronous form and its future.
    t = torch.full((1000,), float(rank), device=device)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    _check(work.get_future().wait()[0], torch.full((1000,), float(world * (world - 1) // 2)), "async all_reduce")
    return dist.get_backend(), checked, backend_path()


def backend_path():
    group = dist.distributed_c10d._get_default_group()
    pg = group if isinstance(group, backend.ProcessGroupChorus) else group._get_backend(torch.device("cuda"))
    return pg._comm.device_path


@pytest.mark.parametrize("path", ["ipc", "staged"])
def test_collectives_on_cuda_tensors(path):
    _need_cuda()
    seed = secrets.randbelow(1 << 30)
    results = run(2, collectives, seed, env={"CHORUS_CUDA_PATH": path})
    for backend_name, checked, taken in results:
        assert backend_name == "chorus" and len(checked) == 5 and taken == path, (backend_name, checked, taken)


def ddp(rank, world, device_type, seed):
    device = _device(rank) if device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5)).to(device)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.index is not None else None)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(seed + 1 + rank)
    for _ in range(20):
        x, y = torch.randn(32, 20, generator=g), torch.randn(32, 5, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp_model(x.to(device)), y.to(device)).backward()
        opt.step()
    return [p.detach().cpu().tolist() for p in model.parameters()]


def test_ddp_on_the_gpu_trains_like_ddp_on_the_cpu():
    _need_cuda()
    seed = secrets.randbelow(1 << 30)
    gpu = run(2, ddp, "cuda", seed)
    cpu = run(2, ddp, "cpu", seed)
    assert gpu[0] == gpu[1]
    for mine, theirs in zip(gpu[0], cpu[0]):
        mine, theirs = torch.tensor(mine), torch.tensor(theirs)
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-5), (mine - theirs).abs().max()


def stream_order(rank, world):
    """NCCL's semantics of calls on CUDA tensors: enqueued, then ordered on torch's streams."""
    device = _device(rank)
    want = float(world * (world + 1) // 2)
    # The call returns while a second of GPU work queued ahead of it, which its input waits
    # for, is still running: neither it nor the stream can have finished.
    t = torch.ones(1 << 20, device=device)
    torch.cuda._sleep(2_000_000_000)
    t.mul_(rank + 1)
    work = dist.all_reduce(t, async_op=True)
    returned_early = not work.is_completed() and not torch.cuda.current_stream(device).query()
    # wait() orders the current stream after the call: work queued next sees the result.
    work.wait()
    after = t.clone()
    _check(after[:1000], torch.full((1000,), want), "the result after wait()")
    # The future's users are ordered after the call too.
    t = torch.full((1000,), float(rank + 1), device=device)
    torch.cuda._sleep(200_000_000)
    future = dist.all_reduce(t, async_op=True).get_future()
    _check(future.then(lambda f: f.value()[0] * 2).wait(), torch.full((1000,), 2 * want), "the future's value")
    # A blocking call's successor on the stream cannot race it.
    t = torch.ones(1 << 20, device=device)
    torch.cuda._sleep(200_000_000)
    dist.all_reduce(t)
    t.mul_(2)
    _check(t[:1000], torch.full((1000,), 2.0 * world), "work queued after a blocking call")
    # A call under graph capture is refused, before anything is enqueued.
    graph, captured = torch.cuda.CUDAGraph(), torch.ones(8, device=device)
    refused = None
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(graph):
            dist.all_reduce(captured)
    except RuntimeError as e:
        refused = str(e)
    # A call that fails (ranks disagree on its length) releases the streams waiting on it;
    # its error reaches the host at a later wait or call.
    bad = torch.ones(16 + rank, device=device)
    work = dist.all_reduce(bad, async_op=True)
    raised = None
    try:
        work.wait()
        torch.cuda.current_stream(device).synchronize()
        dist.all_reduce(torch.ones(4, device=device))
        torch.cuda.synchronize()
        dist.barrier()
    except backend._chorus.ChorusError as e:
        raised = e.cause
    return returned_early, refused, raised


def test_calls_on_cuda_tensors_are_stream_ordered():
    _need_cuda()
    if not backend.ASYNC:
        pytest.skip(f"torch {torch.__version__} runs every call to completion (torch 2.7 and later enqueue them)")
    for returned_early, refused, raised in run(2, stream_order, expect_errors=False):
        assert returned_early, "the call waited for the GPU work queued ahead of it"
        assert refused is not None and "captured into a CUDA graph" in refused, refused
        assert raised == "Mismatch", raised


def host_staged(rank, world, seed):
    """The calls that run on the host, on CUDA tensors (each rank's values from `seed`)."""
    device = _device(rank)
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(world, world, 1000, generator=g)  # data[src][dst]
    out = torch.empty(world * 1000, device=device)
    dist.all_to_all_single(out, data[rank].reshape(-1).to(device))
    _check(out, data[:, rank].reshape(-1), "all_to_all_single")
    # Uneven splits: rank r sends q + 1 rows of 3 to rank q, each row r * 100 + q.
    rows = torch.cat([torch.full((q + 1, 3), float(rank * 100 + q)) for q in range(world)]).to(device)
    out = torch.empty(world * (rank + 1), 3, device=device)
    dist.all_to_all_single(out, rows, [rank + 1] * world, [q + 1 for q in range(world)])
    want = torch.cat([torch.full((rank + 1, 3), float(r * 100 + rank)) for r in range(world)])
    _check(out.reshape(-1), want.reshape(-1), "all_to_all_single with split sizes")
    outs = [torch.empty(5, device=device) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((5,), float(rank * 10 + q), device=device) for q in range(world)])
    _check(torch.cat(outs), torch.cat([torch.full((5,), float(q * 10 + rank)) for q in range(world)]), "all_to_all")
    mine = data[rank, 0].to(device)
    gathered = [torch.empty(1000, device=device) for _ in range(world)] if rank == 1 else None
    dist.gather(mine, gathered, dst=1)
    if rank == 1:
        _check(torch.cat(gathered), data[:, 0].reshape(-1), "gather")
    got = torch.empty(1000, device=device)
    dist.scatter(got, [data[0, q].to(device) for q in range(world)] if rank == 0 else None, src=0)
    _check(got, data[0, rank], "scatter")
    # A ring of 4 MiB both ways at once, into a transposed (non-contiguous) tensor.
    right, left = (rank + 1) % world, (rank - 1) % world
    big = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024) + rank
    into = torch.empty(1024, 1024, device=device).t()
    works = [dist.isend(big.to(device), right), dist.irecv(into, left)]
    for w in works:
        w.wait()
    _check(into.reshape(-1), torch.arange(1 << 20, dtype=torch.float32) + left, "isend and irecv")
    ops = [dist.P2POp(dist.isend, data[rank, right].to(device), right),
           dist.P2POp(dist.irecv, got, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    _check(got, data[left, rank], "batch_isend_irecv")
    if rank == 0:
        source = dist.recv(got)
        _check(got, data[1, 0], "recv without a source")
        return source
    if rank == 1:
        dist.send(data[1, 0].to(device), dst=0)
    return None


def test_calls_on_the_host_take_cuda_tensors():
    _need_cuda()
    results = run(2, host_staged, secrets.randbelow(1 << 30))
    assert results[0] == 1, results


def refusals(rank, world):
    calls = [
        lambda: dist.all_reduce(torch.ones(4, device="meta")),
        lambda: dist.send(torch.ones(4, device="meta"), dst=1 - rank),
    ]
    if torch.cuda.is_available() and backend._CUDA:
        calls.append(lambda: dist.all_gather_into_tensor(torch.ones(2 * world), torch.ones(2, device=_device(rank))))
    errors = failures(calls, ValueError)
    # The group still works: nothing was sent.
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.all(t == world)
    return errors


def test_tensors_on_other_devices_are_refused():
    # Runs without a GPU too: the meta device stands for any other device. Where the backend
    # registers under torch's ProcessGroup for CPU and CUDA (torch 2.7 on), torch's own meta
    # kernels take meta tensors, and they never reach it.
    if backend.ASYNC:
        assert run(2, refusals) == [[], []]
        return
    for errors in run(2, refusals):
        assert 2 <= len(errors) <= 3, errors
        assert all("takes CPU and CUDA tensors" in e and e.endswith("on meta") for e in errors[:2]), errors
        assert errors[2:] == [] or "cannot be mixed" in errors[2], errors
