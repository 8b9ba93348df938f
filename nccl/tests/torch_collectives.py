"""torch.distributed through a backend, as a program on NCCL would use it: every collective on
the device's tensors against exact expected values, a call left in flight with async_op=True,
then DDP of the DDP tutorial's ToyModel and of an MLP (784-256-128-10), each rank printing the
models' parameter norms after the steps, so that two backends' runs can be compared.

tools/gpu-check.sh runs it with backend "nccl" on Chorus's libnccl.so.2 (LD_PRELOAD) and with
the "chorus" backend, on CUDA tensors:

    LD_PRELOAD=$PWD/target/release/libnccl.so torchrun --nproc-per-node 2 \\
        nccl/tests/torch_collectives.py --backend nccl --device cuda
    torchrun --nproc-per-node 2 nccl/tests/torch_collectives.py --backend chorus --device cuda

On CPU tensors any backend runs it (gloo, chorus), which is how the script itself is checked
without a GPU.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def expect(name, got, want):
    if not torch.equal(got.cpu(), want.cpu()):
        raise SystemExit(f"rank {dist.get_rank()}: {name}: got {got.tolist()[:6]}, want {want.tolist()[:6]}")


def collectives(device):
    """Every collective torch offers, on small integers exact in float32."""
    r, w = dist.get_rank(), dist.get_world_size()
    n = 1000
    base = torch.arange(n, dtype=torch.float32)
    t = (base + r).to(device)
    dist.all_reduce(t)
    expect("all_reduce sum", t, base * w + w * (w - 1) / 2)
    t = (base + r).to(device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    expect("all_reduce max", t, base + w - 1)
    t = torch.full((n,), float(r + 1), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    expect("all_reduce product", t, torch.full((n,), float(torch.arange(1, w + 1).prod())))
    t = (base * (r + 1)).to(device)
    dist.broadcast(t, src=w - 1)
    expect("broadcast", t, base * w)
    t = (base + r).to(device)
    dist.reduce(t, dst=0)
    if r == 0:
        expect("reduce", t, base * w + w * (w - 1) / 2)
    out = torch.empty(w * n, device=device)
    dist.all_gather_into_tensor(out, (base + 1000 * r).to(device))
    expect("all_gather_into_tensor", out, torch.cat([base + 1000 * q for q in range(w)]))
    parts = [torch.empty(n, device=device) for _ in range(w)]
    dist.all_gather(parts, (base + 1000 * r).to(device))
    expect("all_gather", torch.cat(parts), torch.cat([base + 1000 * q for q in range(w)]))
    mine = torch.empty(n, device=device)
    dist.reduce_scatter_tensor(mine, torch.cat([base + q for q in range(w)]).to(device))
    expect("reduce_scatter_tensor", mine, (base + r) * w)
    sent = torch.tensor([100.0 * r + q for q in range(w)], device=device)
    got = torch.empty(w, device=device)
    dist.all_to_all_single(got, sent)
    expect("all_to_all_single", got, torch.tensor([100.0 * q + r for q in range(w)]))
    to, frm = (r + 1) % w, (r - 1) % w
    inbox = torch.empty(n, device=device)
    ops = [dist.P2POp(dist.isend, (base + r).to(device), to), dist.P2POp(dist.irecv, inbox, frm)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    expect("send/recv ring", inbox, base + frm)
    big = torch.ones(1 << 22, device=device)
    work = dist.all_reduce(big, async_op=True)
    work.wait()
    expect("all_reduce async_op", big, torch.full((1 << 22,), float(w)))
    dist.barrier()


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))

    def forward(self, x):
        return self.net(x)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                                 nn.Linear(128, 10))

    def forward(self, x):
        return self.net(x)


def trained_norm(model, shape, steps, device):
    """Trains `model` under DDP on rank-dependent data; returns its parameters' norm."""
    rank = dist.get_rank()
    model = model.to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    data = torch.Generator().manual_seed(1000 * rank + 1)
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(64, shape[0], generator=data).to(device)
        y = torch.randn(64, shape[1], generator=data).to(device)
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    return sum(float(p.detach().double().norm()) for p in model.parameters())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.backend == "chorus":
        import chorus_torch  # noqa: F401  (registers the backend)
    dist.init_process_group(backend=args.backend)
    rank = dist.get_rank()
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    collectives(device)
    print(f"rank {rank}: every collective ok on {args.backend}", flush=True)
    torch.manual_seed(0)
    toy = trained_norm(ToyModel(), (10, 5), args.steps, device)
    torch.manual_seed(0)
    mlp = trained_norm(MLP(), (784, 10), args.steps, device)
    print(f"rank {rank}: parameter norms after {args.steps} steps: toy {toy:.6f} mlp {mlp:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
