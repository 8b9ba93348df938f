"""What needs the backend registered under torch's ProcessGroup and its calls in the
background (torch 2.7 and later): errors and futures of Works in flight, communication hooks,
DDP with several buckets, FSDP2 over a CPU DeviceMesh, tensor parallelism through DTensor,
functional collectives, and destroying groups. Each runs with chorus and with gloo, and ends
identical to gloo."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import chorus_torch
import chorus_torch._backend as backend
from harness import run

pytestmark = pytest.mark.skipif(
    not backend.ASYNC, reason=f"torch {torch.__version__} runs chorus's calls synchronously (torch 2.7 and later run them "
                              "in the background)")


def overlapped(rank, world):
    """An all-reduce runs while this thread computes; its Work and future say when it is done."""
    t = torch.full((1 << 22,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    future = work.get_future()
    chained = future.then(lambda f: f.value()[0][:4] * 2)
    busy = torch.randn(256, 256)
    for _ in range(20):
        busy = busy @ busy.T / 256
    work.wait()
    total = world * (world + 1) / 2
    assert torch.all(t == total)
    assert work.is_completed() and future.done()
    return chained.wait().tolist() == [2 * total] * 4


def test_a_call_overlaps_the_callers_work():
    assert run(2, overlapped) == [True, True]


def failing(rank, world):
    """A call that fails (a peer gone) raises from wait(), every time, and through its future."""
    import os
    import signal

    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1 << 16)
    work = dist.all_reduce(t, async_op=True)
    future = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    errors = []
    for _ in range(2):
        try:
            work.wait()
        except chorus_torch.ChorusError as e:
            errors.append((str(e), e.cause, e.culprit, e.found_by))
    try:
        future.wait()
    except RuntimeError as e:
        errors.append((str(e), None, None, None))
    return errors


def test_wait_and_future_raise_chorus_errors():
    results = run(2, failing, expect_errors=True, env={"CHORUS_TIMEOUT": "60"}, timeout=120)
    status, errors = results[0]
    assert status == "ok", results
    assert len(errors) == 3, errors
    assert all("rank 1" in message for message, *_ in errors), errors
    # wait() raises Chorus's own error, with the fault's fields.
    for _, cause, culprit, found_by in errors[:2]:
        assert (cause, culprit, found_by) == ("PeerClosed", 1, 0), errors


def abandoned(rank, world):
    """A Work nobody waits on, whose peer never makes the call, still times out (as NCCL's
    watchdog times out its Works) and fails the group: the next call raises the timeout, on
    the rank that timed out and, once it has, on its peer."""
    import datetime
    import time

    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    cause = None
    if rank == 0:
        work = dist.all_reduce(torch.ones(8), async_op=True)  # never waited on
        deadline = time.monotonic() + 60
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        # Rank 1 never makes that call; it calls once rank 0 has seen its own fail.
        store.wait(["abandoned/seen"], datetime.timedelta(seconds=60))
    try:
        dist.all_reduce(torch.ones(8))
    except chorus_torch.ChorusError as e:
        cause = (e.cause, e.found_by)
    if rank == 0:
        store.set("abandoned/seen", "1")
    return cause


def test_a_work_nobody_waits_on_times_out_and_fails_the_group():
    results = run(2, abandoned, env={"CHORUS_TIMEOUT": "2"}, timeout=120)
    assert results == [("Timeout", 0), ("Timeout", 0)], results


def hooked_ddp(rank, world):
    """DDP with several buckets and a communication hook chained on the futures."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.3)
    ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    torch.manual_seed(1 + rank)
    for _ in range(5):
        ddp(torch.randn(16, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().tolist() for p in model.parameters()]


def _same(a, b):
    """Whether two lists of tensors (as nested lists: tensors do not cross the harness's queue)
    hold the same values."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), rtol=1e-5, atol=1e-6)


def test_ddp_with_buckets_and_a_hook_ends_as_with_gloo():
    chorus = run(2, hooked_ddp)
    gloo = run(2, hooked_ddp, backend="gloo")
    _same(chorus[0], chorus[1])
    _same(chorus[0], gloo[0])


def sharded(rank, world):
    """FSDP2 (`fully_shard`) over a CPU DeviceMesh, then a tensor-parallel pair of layers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    for _ in range(3):
        model(torch.randn(8, 16)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    fsdp = [p.full_tensor().tolist() for p in model.parameters()]

    torch.manual_seed(0)
    tp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    parallelize_module(tp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    torch.manual_seed(7)
    tp(torch.randn(8, 16)).square().sum().backward()
    grads = [p.grad.full_tensor().tolist() for p in tp.parameters()]
    return fsdp, grads


def test_fsdp2_and_tensor_parallelism_end_as_with_gloo():
    chorus = run(2, sharded)
    gloo = run(2, sharded, backend="gloo")
    for mine, theirs in zip(chorus, gloo):
        _same(mine[0], theirs[0])
        _same(mine[1], theirs[1])


def functional_and_groups(rank, world):
    """Functional collectives on a sub-group, and groups destroyed one by one."""
    import torch.distributed._functional_collectives as fc

    group = dist.new_group(list(range(world)))
    reduced = fc.all_reduce(torch.full((4,), float(rank)), "sum", group)
    gathered = fc.all_gather_tensor(torch.tensor([rank]), 0, group)
    out = (reduced.tolist(), gathered.tolist(), dist.get_backend(group))
    dist.destroy_process_group(group)
    other = dist.new_group(list(range(world)))
    t = torch.ones(2)
    dist.all_reduce(t, group=other)
    dist.destroy_process_group(other)
    return out, t.tolist()


def test_functional_collectives_and_destroyed_groups():
    total = float(sum(range(2)))
    assert run(2, functional_and_groups) == [(([total] * 4, [0, 1], "chorus"), [2.0, 2.0])] * 2


def shrinking_ddp(rank, world, victim):
    """The DDP example's training, rank `victim` dying at step 15 of 40."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from ddp_shrink import train

    losses, params, size = train(40, victim, 15, log_every=1000)
    return losses, [p.tolist() for p in params], size


@pytest.mark.skipif(not hasattr(dist, "shrink_group"), reason=f"torch {torch.__version__} has no shrink_group")
@pytest.mark.parametrize("victim", [2, 0])
def test_ddp_loses_a_rank_shrinks_and_trains_on(victim):
    """Rank 2, or rank 0 with the stores it hosted, dies mid-training: the survivors shrink
    the default group, keep identical replicas, and their loss goes on falling."""
    results = run(4, shrinking_ddp, victim, expect_errors=True)
    assert results[victim] == ("error", f"rank {victim} exited with code -9"), results[victim]
    survivors = [results[r] for r in range(4) if r != victim]
    for status, value in survivors:
        assert status == "ok", value
    (losses, params, size), *others = [value for _, value in survivors]
    assert size == 3 and len(losses) == 40
    assert all(other[1] == params and other[2] == 3 for other in others)
    for mine, *_ in [value for _, value in survivors]:
        before, after = sum(mine[10:15]) / 5, sum(mine[-5:]) / 5
        assert after < before / 4, (before, after)


def excluding(rank, world):
    """Rank 2 leaves; ranks 0 and 1 shrink it out of the healthy group, aborting its calls in
    flight first (SHRINK_ABORT), and go on as two."""
    if rank == 2:
        return None
    from torch.distributed.distributed_c10d import SHRINK_ABORT

    group = dist.shrink_group([2], shrink_flags=SHRINK_ABORT)
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t, group=group)
    return dist.get_rank(group), dist.get_world_size(group), t.tolist()


@pytest.mark.skipif(not hasattr(dist, "shrink_group"), reason=f"torch {torch.__version__} has no shrink_group")
def test_shrink_group_leaves_a_live_rank_out():
    results = run(3, excluding)
    assert results == [(0, 2, [3.0] * 8), (1, 2, [3.0] * 8), None]



def callbacks_at_exit(rank, world):
    """A future's slow callback still runs on the completion thread when the caller is done."""
    import time

    future = dist.all_reduce(torch.ones(1 << 20), async_op=True).get_future()
    first = future.then(lambda f: 1)
    future.then(lambda f: time.sleep(0.5))
    first.wait()
    return True


@pytest.mark.parametrize("destroy", [True, False])
def test_the_process_exits_cleanly_with_callbacks_in_flight(destroy):
    """The completion thread finishes its callbacks before the interpreter shuts down (torch
    aborts a thread it finds inside its code then), whether the group is destroyed or not."""
    assert run(2, callbacks_at_exit, destroy=destroy) == [True, True]
