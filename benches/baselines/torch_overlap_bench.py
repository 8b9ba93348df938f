#!/usr/bin/env python3
"""How much of a collective torch.distributed hides behind the caller's work, chorus against
gloo, in one sitting (torch 2.x; chorus runs calls in the background from torch 2.7 on).

(a) An async all-reduce of 16 MiB overlapped with T ms of sleep (work that does not use the
    host's cores, as a GPU's kernels do not), T = the all-reduce's own time: the fraction of
    the shorter of the two that is hidden, (t_ar + T - t_pair) / min(t_ar, T); 1 is perfect.
(b) DDP of four 1024x1024 linear layers whose backward each sleeps S ms (4 MiB buckets, so a
    bucket a layer): the step's time over the no_sync step plus the bare all-reduces of its
    gradients; below 1 means communication hid behind backward. The step is never shorter
    than the no_sync step, so a fast all-reduce cannot take this ratio far below 1: the
    fraction of the bare all-reduces' time hidden, (no_sync + bare - step) / bare, says
    the same thing without favouring a slow one.
(c) With --device cuda: the time for all_reduce(async_op=True) of 64 MiB on CUDA tensors to
    return to Python, warm (the first call excluded), median; the call is enqueued behind
    GPU work, so it measures the host's cost alone.

    python benches/baselines/torch_overlap_bench.py -np 2 --backends chorus,gloo --rounds 3
    python benches/baselines/torch_overlap_bench.py -np 2 --backends chorus,gloo --device cuda

Needs torch and the chorus_torch package (pip install ./python).
"""

import argparse
import os
import statistics
import time

from torch_backend_bench import run

LAYERS, WIDTH = 4, 1024


def median_time(fn, iters):
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def overlap(dist, torch, args):
    """(t_ar, t_pair, hidden fraction) for the 16 MiB all-reduce and T = t_ar of sleep."""
    t = torch.ones(4 << 20)
    for _ in range(3):
        dist.all_reduce(t)
    t_ar = median_time(lambda: dist.all_reduce(t), args.iters)
    # Every rank sleeps the same time: rank 0's figure.
    sleep = torch.tensor([t_ar])
    dist.broadcast(sleep, 0)
    sleep = sleep.item()

    def pair():
        work = dist.all_reduce(t, async_op=True)
        time.sleep(sleep)
        work.wait()

    t_pair = median_time(pair, args.iters)
    return t_ar, t_pair, (t_ar + sleep - t_pair) / min(t_ar, sleep)


def ddp_ratio(dist, torch, args):
    """(step, no_sync step, bare all-reduces, ratio) of DDP on layers whose backward sleeps."""
    nn = torch.nn
    nap = args.sleep_ms / 1e3

    class Sleepy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            time.sleep(nap)
            return grad

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return Sleepy.apply(self.linear(x))

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*[Layer() for _ in range(LAYERS)]), bucket_cap_mb=4)
    x = torch.randn(8, WIDTH)

    def step():
        model(x).sum().backward()

    def local_step():
        with model.no_sync():
            model(x).sum().backward()

    grads = [p.detach().clone() for p in model.parameters()]

    def bare():
        for g in grads:
            dist.all_reduce(g)

    for _ in range(3):
        step()
    t_step = median_time(step, args.iters)
    t_local = median_time(local_step, args.iters)
    t_bare = median_time(bare, args.iters)
    return t_step, t_local, t_bare, t_step / (t_local + t_bare)


def cuda_return(dist, torch, args, rank):
    """The median time, in seconds, for a 64 MiB all_reduce(async_op=True) on CUDA tensors to
    return, each call queued behind a few milliseconds of GPU work."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    t = torch.ones(16 << 20, device=device)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    times = []
    for _ in range(args.iters):
        torch.cuda._sleep(5_000_000)
        start = time.perf_counter()
        work = dist.all_reduce(t, async_op=True)
        times.append(time.perf_counter() - start)
        work.wait()
        torch.cuda.synchronize()
    return statistics.median(times)


def rank_main(rank, world, port, backend, args, results):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "chorus":
        import chorus_torch  # noqa: F401
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if args.device == "cuda":
        out = {"return": cuda_return(dist, torch, args, rank)}
    else:
        out = {"overlap": overlap(dist, torch, args), "ddp": ddp_ratio(dist, torch, args)}
    dist.destroy_process_group()
    if rank == 0:
        results.put(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-np", default="2", help="comma-separated world sizes")
    p.add_argument("--backends", default="chorus,gloo")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every backend")
    p.add_argument("--sleep-ms", type=float, default=5.0, help="each layer's backward sleep (b)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: (c) alone")
    args = p.parse_args()
    for world in [int(w) for w in args.np.split(",")]:
        got = {b: [] for b in args.backends.split(",")}
        for _ in range(args.rounds):
            for b in got:
                got[b].append(run(world, b, args, rank_main))
        print(f"# W={world}, torch {__import__('torch').__version__}, {args.rounds} round(s), medians of {args.iters}")
        if args.device == "cuda":
            print("(c) 64 MiB all_reduce(async_op=True) on CUDA tensors: time to return")
            for b, rounds in got.items():
                for r in rounds:
                    print(f"{b:>8} {r['return'] * 1e6:10.1f} us")
            continue
        print("(a) 16 MiB all_reduce(async_op=True) with T = its time of sleep")
        print(f"{'backend':>8} {'t_ar ms':>8} {'pair ms':>8} {'hidden':>7}")
        for b, rounds in got.items():
            for r in rounds:
                t_ar, pair, hidden = r["overlap"]
                print(f"{b:>8} {t_ar * 1e3:8.2f} {pair * 1e3:8.2f} {hidden:7.2f}")
        print(f"(b) DDP, {LAYERS} layers of {WIDTH}x{WIDTH}, backward sleeping {args.sleep_ms} ms a layer, 4 MiB buckets")
        print(f"{'backend':>8} {'step ms':>8} {'no_sync':>8} {'bare ar':>8} {'ratio':>7} {'hidden':>7}")
        for b, rounds in got.items():
            for r in rounds:
                step, local, bare, ratio = r["ddp"]
                hidden = (local + bare - step) / bare
                print(f"{b:>8} {step * 1e3:8.2f} {local * 1e3:8.2f} {bare * 1e3:8.2f} {ratio:7.2f} {hidden:7.2f}")


if __name__ == "__main__":
    main()
