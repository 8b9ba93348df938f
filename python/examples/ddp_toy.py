"""The DDP tutorial's ToyModel, on the chorus backend (or any other: --backend), on CPU or
with --device cuda on the GPUs (rank r on GPU r modulo their number, as the tutorial does).

Run under any launcher that sets torchrun's variables, e.g.
    torchrun --nproc-per-node 2 python/examples/ddp_toy.py
    chorusrun --nproc-per-node 2 python3 python/examples/ddp_toy.py --device cuda
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import chorus_torch  # noqa: F401  (registers the "chorus" backend)


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def train(steps, seed=0, device="cpu"):
    """Trains a DDP ToyModel for `steps` steps on rank-dependent data on `device` ("cpu" or
    "cuda"); returns its parameters, on the CPU."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    if device == "cuda":
        gpu = rank % torch.cuda.device_count()
        torch.cuda.set_device(gpu)
        model = ToyModel().to(gpu)
        ddp_model = DDP(model, device_ids=[gpu])
    else:
        model = ToyModel()
        ddp_model = DDP(model)
    at = next(model.parameters()).device
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(seed + 1000 * rank)
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=data).to(at))
        labels = torch.randn(20, 5, generator=data).to(at)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    return [p.detach().cpu().clone() for p in model.parameters()]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="chorus")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here")
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    print(f"[{os.getpid()}] Initializing process group with: {env}")
    dist.init_process_group(backend=args.backend)
    print(f"[{os.getpid()}] world_size = {dist.get_world_size()}, rank = {dist.get_rank()}, "
          f"backend={dist.get_backend()}")
    params = train(args.steps, device=args.device)
    norm = sum(float(p.norm()) for p in params)
    print(f"[{os.getpid()}] rank = {dist.get_rank()}: trained {args.steps} steps, parameter norm {norm:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
