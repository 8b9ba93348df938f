"""Every operation x dtype x reduce op against exact expected values, at W = 1 to 4."""

import pytest
import torch
import torch.distributed as dist

from harness import run

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool]
OPS = {"SUM": dist.ReduceOp.SUM, "PRODUCT": dist.ReduceOp.PRODUCT, "MIN": dist.ReduceOp.MIN,
       "MAX": dist.ReduceOp.MAX, "AVG": dist.ReduceOp.AVG, "BAND": dist.ReduceOp.BAND,
       "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}
# Uneven sizes: empty, one element, odd, and more than one pipeline chunk of f32.
SIZES = [0, 1, 13, 70001]


def values(rank, n, dtype, salt=0):
    """Rank `rank`'s contribution: small values (exact in every dtype, no overflow in products
    over four ranks), negative ones where the dtype has them."""
    i = torch.arange(n, dtype=torch.int64)
    if dtype == torch.bool:
        return ((i * 7 + rank * 3 + salt) % 3 == 0)
    if dtype == torch.uint8:
        return ((i + rank * 5 + salt) % 4).to(dtype)
    return ((i * 7 + rank * 3 + salt) % 5 - 2).to(dtype)


def expected_reduce(name, world, n, dtype, salt=0):
    stack = torch.stack([values(r, n, dtype, salt).to(torch.int64 if not dtype.is_floating_point else torch.float64)
                         for r in range(world)])
    if dtype == torch.bool:
        logical = {"SUM": stack.amax(0), "MAX": stack.amax(0), "BOR": stack.amax(0), "PRODUCT": stack.amin(0),
                   "MIN": stack.amin(0), "BAND": stack.amin(0), "BXOR": stack.sum(0) % 2}
        return logical[name].to(torch.bool)
    if name == "SUM":
        out = stack.sum(0)
    elif name == "PRODUCT":
        out = stack.prod(0)
    elif name == "MIN":
        out = stack.amin(0)
    elif name == "MAX":
        out = stack.amax(0)
    elif name == "AVG":
        out = stack.sum(0) / world if dtype.is_floating_point else torch.div(stack.sum(0), world, rounding_mode="trunc")
    else:
        out = stack[0].clone()
        for row in stack[1:]:
            out = {"BAND": out & row, "BOR": out | row, "BXOR": out ^ row}[name]
    return out.to(dtype)


def applies(name, dtype):
    if dtype == torch.bool:
        return name != "AVG"
    return not (name.startswith("B") and dtype.is_floating_point)


def check(got, want, what):
    if got.dtype.is_floating_point:
        ok = torch.allclose(got.double(), want.double(), rtol=1e-2, atol=1e-2)
    else:
        ok = torch.equal(got, want)
    assert ok, f"{what}: got {got[:8].tolist()}... want {want[:8].tolist()}..."


def matrix(rank, world):
    """Every operation on this world; returns how many results were checked."""
    checks = 0
    for dtype in DTYPES:
        for n in SIZES:
            # all_reduce, every op; one non-contiguous case per dtype.
            for name, op in OPS.items():
                if not applies(name, dtype):
                    continue
                t = values(rank, n, dtype)
                dist.all_reduce(t, op=op)
                check(t, expected_reduce(name, world, n, dtype), f"all_reduce {name} {dtype} n={n}")
                checks += 1
            if n > 1:
                t = values(rank, 2 * n, dtype)[::2]
                assert not t.is_contiguous()
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                check(t, expected_reduce("MAX", world, 2 * n, dtype)[::2], f"strided all_reduce {dtype}")
                checks += 1
            for root in range(world):
                t = values(rank, n, dtype) if rank == root else torch.zeros(n, dtype=dtype)
                dist.broadcast(t, src=root)
                check(t, values(root, n, dtype), f"broadcast {dtype} n={n} root={root}")
                t = values(rank, n, dtype)
                dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)
                if rank == root:
                    check(t, expected_reduce("SUM", world, n, dtype), f"reduce {dtype} n={n} root={root}")
                # gather / scatter
                mine = values(rank, n, dtype)
                gathered = [torch.zeros(n, dtype=dtype) for _ in range(world)] if rank == root else None
                dist.gather(mine, gather_list=gathered, dst=root)
                if rank == root:
                    for q in range(world):
                        check(gathered[q], values(q, n, dtype), f"gather {dtype} n={n} from {q}")
                out = torch.zeros(n, dtype=dtype)
                pieces = [values(q, n, dtype, salt=root) for q in range(world)] if rank == root else None
                dist.scatter(out, scatter_list=pieces, src=root)
                check(out, values(rank, n, dtype, salt=root), f"scatter {dtype} n={n} root={root}")
                checks += 4
            # all_gather (list form and into one tensor)
            outs = [torch.zeros(n, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, values(rank, n, dtype))
            for q in range(world):
                check(outs[q], values(q, n, dtype), f"all_gather {dtype} n={n}")
            flat = torch.zeros(world * n, dtype=dtype)
            dist.all_gather_into_tensor(flat, values(rank, n, dtype)) if hasattr(dist, "all_gather_into_tensor") \
                else dist._all_gather_base(flat, values(rank, n, dtype))
            check(flat, torch.cat([values(q, n, dtype) for q in range(world)]), f"all_gather_into_tensor {dtype}")
            # in place: the input is this rank's block of the output
            flat = torch.zeros(world * n, dtype=dtype)
            flat[rank * n:(rank + 1) * n] = values(rank, n, dtype)
            dist.all_gather_into_tensor(flat, flat[rank * n:(rank + 1) * n]) if hasattr(dist, "all_gather_into_tensor") \
                else dist._all_gather_base(flat, flat[rank * n:(rank + 1) * n])
            check(flat, torch.cat([values(q, n, dtype) for q in range(world)]), f"in-place all_gather {dtype}")
            checks += 3
            # reduce_scatter (list form and from one tensor)
            if dtype != torch.bool:
                want = expected_reduce("SUM", world, world * n, dtype)[rank * n:(rank + 1) * n]
                full = values(rank, world * n, dtype)
                out = torch.zeros(n, dtype=dtype)
                dist.reduce_scatter(out, list(full.chunk(world)) if n else [torch.zeros(0, dtype=dtype)] * world)
                check(out, want, f"reduce_scatter {dtype} n={n}")
                out = torch.zeros(n, dtype=dtype)
                rs = getattr(dist, "reduce_scatter_tensor", None) or dist._reduce_scatter_base
                rs(out, full)
                check(out, want, f"reduce_scatter_tensor {dtype} n={n}")
                checks += 2
            # all_to_all_single, equal and uneven splits; list form
            full = values(rank, world * n, dtype, salt=1)
            out = torch.zeros(world * n, dtype=dtype)
            dist.all_to_all_single(out, full)
            want = torch.cat([values(q, world * n, dtype, salt=1)[rank * n:(rank + 1) * n] for q in range(world)])
            check(out, want, f"all_to_all_single {dtype} n={n}")
            # rank q sends (q + p + 1) % 3 rows of 2 to rank p
            rows = lambda q, p: (q + p + 1) % 3  # noqa: E731
            send = [rows(rank, p) for p in range(world)]
            recv = [rows(q, rank) for q in range(world)]
            inp = values(rank, 2 * sum(send), dtype, salt=2).reshape(-1, 2)
            out = torch.zeros(sum(recv), 2, dtype=dtype)
            dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
            want = []
            for q in range(world):
                theirs = values(q, 2 * sum(rows(q, p) for p in range(world)), dtype, salt=2).reshape(-1, 2)
                start = sum(rows(q, p) for p in range(rank))
                want.append(theirs[start:start + rows(q, rank)])
            check(out, torch.cat(want), f"uneven all_to_all_single {dtype}")
            outs = [torch.zeros(rows(q, rank), dtype=dtype) for q in range(world)]
            ins = [values(rank, rows(rank, p), dtype, salt=p) for p in range(world)]
            dist.all_to_all(outs, ins)
            for q in range(world):
                check(outs[q], values(q, rows(q, rank), dtype, salt=rank), f"all_to_all {dtype}")
            checks += 3
    # coalesced all_reduce; point to point around a ring; barrier
    ts = [values(rank, k, torch.float32) for k in (3, 0, 5)]
    if hasattr(dist, "all_reduce_coalesced"):
        dist.all_reduce_coalesced(ts)
        for t, k in zip(ts, (3, 0, 5)):
            check(t, expected_reduce("SUM", world, k, torch.float32), "all_reduce_coalesced")
        checks += 1
    if world > 1:
        right, left = (rank + 1) % world, (rank - 1) % world
        got = torch.zeros(9, dtype=torch.int64)
        reqs = [dist.isend(values(rank, 9, torch.int64), right), dist.irecv(got, left)]
        for r in reqs:
            r.wait()
        check(got, values(left, 9, torch.int64), "isend/irecv")
        checks += 1
    dist.barrier()
    return checks


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_operation_dtype_and_op(world):
    counts = run(world, matrix, timeout=600)
    assert len(set(counts)) == 1 and counts[0] > 500, counts
