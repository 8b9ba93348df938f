#!/usr/bin/env python3
"""torch.distributed through the chorus backend against gloo, in one sitting.

For each world size: the time of `dist.all_reduce` and `dist.broadcast` (root 0) on float32
tensors (8 B to 64 MiB, mean per call over ranks, with nccl-tests' bus bandwidth) and of
`dist.barrier`, then DDP training throughput (samples/s summed over ranks) for the DDP
tutorial's ToyModel and for `train`'s MLP (784-256-128-10, batch 64 per rank, SGD with
momentum):

    /usr/bin/python3 benches/baselines/torch_backend_bench.py -np 2,4
    /usr/bin/python3 benches/baselines/torch_backend_bench.py -np 2,4 --sizes 8,64M --steps 0
    python3 benches/baselines/torch_backend_bench.py -np 2 --device cuda --backends chorus,gloo

With `--device cuda` the tensors and the DDP models are on the GPUs (rank r on GPU r modulo
their number), and each timing waits for the GPU's queued work before reading the clock.

Needs torch and the chorus_torch package (pip install ./python).
"""

import argparse
import multiprocessing as mp
import os
import socket
import time


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20}
    s = s.strip().upper()
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iters_for(nbytes, args):
    return args.small_iters if nbytes <= 64 << 10 else args.iters


# Each operation: the call on a tensor, and nccl-tests' bus bandwidth factor at W ranks.
OPS = {
    "allreduce": (lambda dist, t: dist.all_reduce(t), lambda w: 2 * (w - 1) / w),
    "broadcast": (lambda dist, t: dist.broadcast(t, 0), lambda w: 1),
    "barrier": (lambda dist, t: dist.barrier(), lambda w: 0),
}


def synchronizer(torch, device):
    """Waits for the work queued on `device` (nothing to wait for on the CPU)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def bench_op(dist, torch, world, op, args, device, reduces=True):
    """(bytes, us per call, busbw) for each size (one row of 0 bytes for a barrier)."""
    call, factor = OPS[op]
    sync = synchronizer(torch, device)
    sizes = [0] if op == "barrier" else [parse_size(s) for s in args.sizes.split(",")]
    rows = []
    for nbytes in sizes:
        t = torch.ones(max(nbytes // 4, 1), device=device)
        n = iters_for(nbytes, args)
        for _ in range(max(n // 10, 2)):
            call(dist, t)
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            call(dist, t)
        sync()
        took = (time.perf_counter() - start) / n
        if reduces:  # the mean over ranks (the floor's group reduces nothing: rank 0's own)
            mean = torch.tensor([took], dtype=torch.float64)
            dist.all_reduce(mean)
            took = mean.item() / world
        busbw = nbytes / took * factor(world) / 1e9
        rows.append((nbytes, took * 1e6, busbw))
    return rows


def bench_ddp(dist, torch, world, model_name, args, device):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    if model_name == "toy":
        model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
        x, y, batch = torch.randn(20, 10), torch.randn(20, 5), 20
        loss_fn = nn.MSELoss()
    else:
        model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
        x, y, batch = torch.randn(64, 784), torch.randint(0, 10, (64,)), 64
        loss_fn = nn.CrossEntropyLoss()
    model, x, y = model.to(device), x.to(device), y.to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    sync = synchronizer(torch, device)

    def step():
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()

    for _ in range(20):
        step()
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    dist.barrier()
    took = time.perf_counter() - start
    return args.steps * batch * world / took


def register_floor(dist, torch):
    """A Python process group whose operations only read the tensor's address: the cost of
    torch's Python path to a backend, which no Python backend can go below. It takes the
    shape chorus_torch takes under this torch: a `Backend` under torch's ProcessGroup from
    torch 2.7 on (reached through torch's dispatcher), a ProcessGroup subclass before."""
    import torch._C._distributed_c10d as c10d
    from torch._C._distributed_c10d import _create_work_from_future

    registered = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 7)

    class Floor(c10d.Backend if registered else c10d.ProcessGroup):
        def allreduce(self, tensors, opts=None):
            tensors[0].data_ptr()
            future = torch.futures.Future()
            future.set_result(tensors)
            return _create_work_from_future(future)

        def barrier(self, opts=None):
            return self.allreduce([torch.zeros(1)])

        def getBackendName(self):
            return "floor"

    create = lambda store, rank, size, timeout: Floor(rank, size)  # noqa: E731
    try:
        dist.Backend.register_backend("floor", create, devices=["cpu", "cuda"])
    except TypeError:  # torch before 2.1 takes no devices
        dist.Backend.register_backend("floor", create)


def rank_main(rank, world, port, backend, args, results):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if backend == "chorus":
        import chorus_torch  # noqa: F401
    if backend == "floor":
        register_floor(dist, torch)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # The floor's group has only all_reduce (and a barrier made of it).
    ops = ["allreduce"] if backend == "floor" else args.ops.split(",")
    out = {op: bench_op(dist, torch, world, op, args, device, reduces=backend != "floor") for op in ops}
    for name in ("toy", "mlp"):
        out[name] = bench_ddp(dist, torch, world, name, args, device) if backend != "floor" and args.steps else float("nan")
    dist.destroy_process_group()
    if rank == 0:
        results.put(out)


def run(world, backend, args, target=None):
    """`target(rank, world, port, backend, args, results)` (this file's `rank_main` unless
    given) on `world` spawned processes; what rank 0 puts in `results`."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    env = {"GLOO_SOCKET_IFNAME": "lo"}
    os.environ.update(env)
    procs = [ctx.Process(target=target or rank_main, args=(r, world, port, backend, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    out = results.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-np", default="2,4", help="comma-separated world sizes")
    p.add_argument("--ops", default="allreduce,broadcast,barrier", help="comma-separated: " + ",".join(OPS))
    p.add_argument("--sizes", default="8,1K,64K,1M,16M,64M")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("--small-iters", type=int, default=2000)
    p.add_argument("--steps", type=int, default=300, help="DDP steps timed (0: no DDP)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the tensors and models are")
    p.add_argument("--backends", default="chorus,gloo,floor",
                   help="floor: a process group that does nothing (torch's own cost per call)")
    args = p.parse_args()
    unknown = set(args.ops.split(",")) - set(OPS)
    if unknown:
        p.error(f"unknown --ops {sorted(unknown)}: choose among {', '.join(OPS)}")
    for world in [int(w) for w in args.np.split(",")]:
        got = {b: run(world, b, args) for b in args.backends.split(",")}
        for op in args.ops.split(","):
            names = [n for n in got if op in got[n]]
            compare = "chorus" in names and "gloo" in names
            print(f"\n# W={world}: {op} float32, time per call (us) and busbw (GB/s)")
            print(f"{'bytes':>10} " + " ".join(f"{n + ' us':>12} {n + ' GB/s':>12}" for n in names)
                  + ("   chorus speed-up" if compare else ""))
            for i, (nbytes, _, _) in enumerate(got[names[0]][op]):
                cells = " ".join(f"{got[n][op][i][1]:12.2f} {got[n][op][i][2]:12.3f}" for n in names)
                ratio = f"   x{got['gloo'][op][i][1] / got['chorus'][op][i][1]:.1f}" if compare else ""
                print(f"{nbytes:>10} {cells}{ratio}")
        if args.steps:
            print(f"# W={world}: DDP samples/s (all ranks)")
            for model in ("toy", "mlp"):
                print(f"{model:>10} " + " ".join(f"{n}: {got[n][model]:10.0f}" for n in got))


if __name__ == "__main__":
    main()
