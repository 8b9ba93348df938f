"""Asynchronous calls and futures, sub-groups, object collectives, errors, and DDP."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import chorus_torch

from harness import failures, run


def async_and_futures(rank, world):
    big = torch.full((1 << 20,), float(rank + 1))  # large enough to run in the background
    small = torch.full((5,), float(rank + 1))
    w1 = dist.all_reduce(big, async_op=True)
    w2 = dist.all_reduce(small, async_op=True)
    chained = w1.get_future().then(lambda f: f.value()[0] * 2)
    w2.wait()
    w1.wait()
    total = world * (world + 1) / 2
    assert w1.is_completed() and w2.is_completed()
    assert torch.all(big == total) and torch.all(small == total)
    assert torch.all(chained.wait() == 2 * total)
    # A future asked for after completion is already done.
    w3 = dist.all_reduce(small, async_op=True)
    w3.wait()
    assert torch.all(w3.get_future().wait()[0] == total * world)
    # Many queued calls complete in issue order.
    bufs = [torch.full((1 << 17,), float(i)) for i in range(6)]
    works = [dist.broadcast(b, src=i % world, async_op=True) for i, b in enumerate(bufs)]
    for w in works:
        w.wait()
    for i, b in enumerate(bufs):
        assert torch.all(b == float(i))
    return True


def test_async_operations_and_futures():
    assert run(3, async_and_futures) == [True] * 3


def subgroups(rank, world):
    evens = dist.new_group([0, 2])
    odds = dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    assert t.item() == (2.0 if rank % 2 == 0 else 4.0), t
    # groups of two consecutive ranks (torch 1.13's new_subgroups needs CUDA; 2.x's does not)
    if torch.__version__ >= "2":
        sub, _ = dist.new_subgroups(group_size=2)
    else:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        sub = pairs[rank // 2]
    t = torch.tensor([rank])
    dist.all_reduce(t, group=sub)
    assert t.item() == (1 if rank < 2 else 5), t
    # the world group still works after sub-groups
    t = torch.tensor([1])
    dist.all_reduce(t)
    assert t.item() == world
    return True


def test_subgroups():
    assert run(4, subgroups) == [True] * 4


def objects(rank, world):
    got = [None] * world
    dist.all_gather_object(got, {"rank": rank, "name": f"r{rank}"})
    assert got == [{"rank": r, "name": f"r{r}"} for r in range(world)]
    items = [["hello", 3.5], {"k": 1}] if rank == 1 else [None, None]
    dist.broadcast_object_list(items, src=1)
    assert items == [["hello", 3.5], {"k": 1}]
    out = [None] if rank != 0 else [None]
    dist.scatter_object_list(out, [f"to {r}" for r in range(world)] if rank == 0 else None, src=0)
    assert out[0] == f"to {rank}"
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(rank * 10, gathered, dst=0)
    if rank == 0:
        assert gathered == [r * 10 for r in range(world)]
    return True


def test_object_collectives():
    assert run(3, objects) == [True] * 3


def any_source(rank, world):
    if rank != 0:
        dist.send(torch.full((3,), float(rank)), dst=0)
        tag = 2 + rank  # rank 1: 3, rank 2: 4
        dist.send(torch.full((2,), float(10 * tag)), dst=0, tag=tag)
        return None
    got = {}
    for _ in range(world - 1):
        t = torch.zeros(3, 2)[:, 1]  # not contiguous: received through a staging copy
        src = dist.recv(t)
        got[src] = t.tolist()
    # Rank 1's next message has tag 3: a receive of tag 4 from any source takes rank 2's.
    t = torch.zeros(2)
    work = dist.irecv(t, tag=4)
    work.wait()
    tagged = [(work._source_rank(), t.tolist())]
    tagged.append((dist.recv(t, tag=3), t.tolist()))
    return got, tagged


def test_recv_without_a_source_names_each_sender():
    results = run(3, any_source)
    got, tagged = results[0]
    assert got == {1: [1.0] * 3, 2: [2.0] * 3}, got
    assert tagged == [(2, [40.0] * 2), (1, [30.0] * 2)], tagged


def exchange_both_ways(rank, world):
    after, before = (rank + 1) % world, (rank - 1) % world
    n = 8 << 20  # 32 MiB each way, far past the sockets' buffers: sends run one at a time would wait on each other
    out, into = torch.full((n,), float(rank)), torch.empty(n)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, after), dist.P2POp(dist.irecv, into, before)])
    for req in reqs:
        req.wait()
    assert torch.all(into == float(before))
    # An isend not yet waited on runs with the blocking recv after it, into a non-contiguous tensor.
    work = dist.isend(out, after, tag=3)
    column = torch.zeros(n, 2)[:, 1]
    dist.recv(column, before, tag=3)
    assert work.is_completed()
    work.wait()
    assert torch.all(column == float(before))
    # A receive into memory another call of its batch uses is refused before anything is sent.
    refused = None
    try:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, out[:10], after), dist.P2POp(dist.irecv, out[5:15], before)])[0].wait()
    except ValueError as e:
        refused = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    return refused


def test_isend_and_irecv_run_together():
    for refused in run(3, exchange_both_ways, timeout=120, env={"CHORUS_TIMEOUT": "60"}):
        assert refused is not None and "shares memory with call 0" in refused, refused


def bad_arguments(rank, world):
    errors = failures((
        lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND),
        lambda: dist.broadcast(torch.ones(3), src=world + 5),
        lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16)),
        lambda: dist.all_gather([torch.ones(2)] * (world + 1), torch.ones(2)),
        lambda: dist.all_to_all_single(torch.ones(4), torch.ones(4), [1] * world, [1] * world),
    ))
    # The group still works: nothing was sent.
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.all(t == world)
    return errors


def test_bad_arguments_fail_before_anything_is_sent():
    results = run(2, bad_arguments)
    for errors in results:
        assert len(errors) == 5, errors
    assert any("BAND" in e for e in results[0]), results[0]
    assert any("root 7 is not a rank" in e for e in results[0]), results[0]
    assert any("torch.int16" in e for e in results[0]), results[0]


def mismatch(rank, world):
    t = torch.ones(4 if rank == 0 else 6)
    try:
        dist.all_reduce(t)
    except chorus_torch.ChorusError as e:
        return e.cause, e.culprit, str(e)
    return None


def test_mismatched_calls_fail_on_every_rank():
    """Every rank raises ChorusError for the one fault, naming what each called."""
    results = run(2, mismatch, env={"CHORUS_TIMEOUT": "20"})
    for result in results:
        assert result is not None, results
        cause, culprit, text = result
        assert cause == "Mismatch" and culprit in (0, 1), result
        assert "4 elements" in text and "6 elements" in text, text


def killed(rank, world):
    t = torch.ones(1 << 10)
    dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except RuntimeError as e:
        return (time.monotonic() - start, str(e))
    return None


def test_a_killed_rank_fails_its_peers_within_seconds():
    results = run(3, killed, expect_errors=True, env={"CHORUS_TIMEOUT": "120"}, timeout=90)
    for rank in (0, 2):
        status, value = results[rank]
        assert status == "ok" and value is not None, results[rank]
        waited, text = value
        assert waited < 30, (waited, text)
        assert "rank 1" in text or "peer 1" in text, text


def ddp_params(rank, world, steps):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from ddp_toy import train

    return [p.tolist() for p in train(steps)]


def test_ddp_trains_like_gloo():
    chorus = run(2, ddp_params, 50)
    gloo = run(2, ddp_params, 50, backend="gloo")
    # DDP keeps replicas identical, and chorus's replicas match gloo's.
    assert chorus[0] == chorus[1]
    for mine, theirs in zip(chorus[0], gloo[0]):
        assert torch.allclose(torch.tensor(mine), torch.tensor(theirs), rtol=1e-5, atol=1e-6)
    # Training moved the parameters from their initial values.
    torch.manual_seed(0)
    sys_path_model = ddp_initial()
    assert any(not torch.allclose(torch.tensor(m), p) for m, p in zip(chorus[0], sys_path_model))


def ddp_initial():
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from ddp_toy import ToyModel

    torch.manual_seed(0)
    return [p.detach() for p in ToyModel().parameters()]


def test_ddp_example_runs_under_a_launcher_with_three_ranks():
    results = run(3, ddp_params, 5)
    assert results[0] == results[1] == results[2]
