#!/usr/bin/env python3
"""Baselines for the perf tools: the same measurements through Gloo or Open MPI.

Times all-reduce, broadcast (from rank 0) and barrier on float32 buffers the
way the perf tools do (warm-up calls, a barrier, then the mean time of
--iters calls, averaged over ranks), and prints one line per (op, size) with
nccl-tests' algbw and busbw:

    gloo:  /usr/bin/python3 benches/baselines/collective_bench.py --backend gloo -np 4
    mpi:   mpirun -np 4 --oversubscribe --mca btl tcp,self --mca btl_tcp_if_include lo \\
               /usr/bin/python3 benches/baselines/collective_bench.py --backend mpi

Gloo ranks are started here (one process each, rendezvous on 127.0.0.1,
GLOO_SOCKET_IFNAME=lo); MPI ranks come from mpirun (mpi4py).

Pages: numpy asks for transparent huge pages for its arrays (madvise), torch
does not; where THP is "madvise", copies between processes on huge pages run
about twice as fast. The MPI backend's numpy buffers are therefore on small
pages, like a torch tensor and the perf tools' buffers, unless --hugepages
(the perf tools' --hugepages is the same advice).
"""

import argparse
import os
import socket
import sys
import time

BUS_FACTOR = {
    "allreduce": lambda w: 2.0 * (w - 1) / w,
    "broadcast": lambda w: 1.0,
    "barrier": lambda w: 0.0,
}


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper()
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["gloo", "mpi"], required=True)
    p.add_argument("-np", type=int, default=2, help="ranks to start (gloo only)")
    p.add_argument("--ops", default="allreduce,broadcast,barrier")
    p.add_argument("--sizes", default="8,64M", help="comma-separated bytes (K, M suffixes)")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--small-iters", type=int, default=1000,
                   help="iterations for sizes up to 64 KiB and for barrier")
    p.add_argument("--warmup-seconds", type=float, default=0.0,
                   help="sizes up to 64 KiB and barrier: after --warmup calls, go on warming "
                        "up until rank 0 has spent this long (a job's first few hundred "
                        "milliseconds of small calls run slower where ranks outnumber cores)")
    p.add_argument("--hugepages", action="store_true",
                   help="MPI backend: numpy's arrays on transparent huge pages (its default)")
    return p.parse_args(argv)


class Gloo:
    def __init__(self, rank, world, port):
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
        self.rank, self.world = rank, world

    def buffer(self, nbytes):
        return self.torch.ones(max(nbytes // 4, 1), dtype=self.torch.float32)

    def run(self, op, buf):
        if op == "allreduce":
            self.dist.all_reduce(buf)
        elif op == "broadcast":
            self.dist.broadcast(buf, 0)
        else:
            self.dist.barrier()

    def mean(self, value):
        t = self.torch.tensor([value], dtype=self.torch.float64)
        self.dist.all_reduce(t)
        return t.item() / self.world


class Mpi:
    def __init__(self, hugepages):
        from mpi4py import MPI
        import numpy
        numpy.core.multiarray._set_madvise_hugepage(hugepages)
        self.MPI, self.np, self.hugepages = MPI, numpy, hugepages
        self.comm = MPI.COMM_WORLD
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()

    def buffer(self, nbytes):
        n = max(nbytes // 4, 1)
        return (self.np.ones(n, dtype=self.np.float32), self.np.empty(n, dtype=self.np.float32))

    def run(self, op, buf):
        if op == "allreduce":
            self.comm.Allreduce(buf[0], buf[1], op=self.MPI.SUM)
        elif op == "broadcast":
            self.comm.Bcast(buf[0], root=0)
        else:
            self.comm.Barrier()

    def mean(self, value):
        return self.comm.allreduce(value, op=self.MPI.SUM) / self.world


def warm_up_for(backend, op, buf, seconds, block=100):
    """Runs `op` in blocks of calls until rank 0 has spent `seconds`; rank 0 decides for all."""
    start = time.perf_counter()
    while True:
        late = backend.rank == 0 and time.perf_counter() - start >= seconds
        if backend.mean(0.0 if late or backend.rank else 1.0) == 0.0:
            return
        for _ in range(block):
            backend.run(op, buf)


def measure(backend, args):
    rows = []
    for op in args.ops.split(","):
        sizes = [0] if op == "barrier" else [parse_size(s) for s in args.sizes.split(",")]
        for size in sizes:
            buf = backend.buffer(size)
            small = size <= 64 << 10
            iters = args.small_iters if small else args.iters
            for _ in range(args.warmup):
                backend.run(op, buf)
            if small and args.warmup_seconds > 0:
                warm_up_for(backend, op, buf, args.warmup_seconds)
            backend.run("barrier", buf)
            start = time.perf_counter()
            for _ in range(iters):
                backend.run(op, buf)
            seconds = backend.mean((time.perf_counter() - start) / iters)
            algbw = size / seconds / 1e9
            rows.append((op, size, seconds * 1e6, algbw, algbw * BUS_FACTOR[op](backend.world)))
    if backend.rank == 0:
        name = "gloo (torch %s)" % __import__("torch").__version__ if isinstance(backend, Gloo) \
            else "%s (mpi4py)" % backend.MPI.Get_library_version().split(",")[0].strip()
        pages = "huge" if getattr(backend, "hugepages", False) else "small"
        print(f"# {name}, {backend.world} ranks, float32 sum, buffers on {pages} pages")
        print(f"# {'op':>9} {'size':>12} {'time(us)':>10} {'algbw':>8} {'busbw':>8}")
        for op, size, us, algbw, busbw in rows:
            print(f"  {op:>9} {size:>12} {us:>10.2f} {algbw:>8.3f} {busbw:>8.3f}")
        sys.stdout.flush()


def gloo_rank(rank, world, port, argv):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = Gloo(rank, world, port)
    measure(backend, parse_args(argv))
    backend.dist.barrier()
    backend.dist.destroy_process_group()


def main():
    args = parse_args()
    if args.backend == "mpi":
        measure(Mpi(args.hugepages), args)
        return
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(gloo_rank, args=(args.np, port, sys.argv[1:]), nprocs=args.np, join=True)


if __name__ == "__main__":
    main()
