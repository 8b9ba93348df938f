"""DDP that loses a rank and goes on, on the chorus backend.

Every rank fits a linear model to its own share of one noisy linear problem with DDP. At
step --die-at, rank --victim kills itself (SIGKILL, as the OOM killer would). The survivors'
DDP step fails; each reads why (`chorus_torch.failure()`: its culprit is the dead rank),
shrinks the default group to the ranks left (`torch.distributed.shrink_group`, torch 2.15
and later), wraps the model in DDP again over the new group, and does the step again. Each
prints its loss as it goes, so the curve is seen to go on across the loss.

Start it with a launcher that lets the survivors run on:
    chorusrun --standalone --nproc-per-node 4 --survive python3 python/examples/ddp_shrink.py
"""

import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import chorus_torch


def train(steps, victim, die_at, seed=0, log_every=10):
    """Trains for `steps` steps, rank `victim` dying at step `die_at` (none when negative);
    returns the losses, the final parameters, and the group's size at the end."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    truth = torch.randn(16, 1, generator=torch.Generator().manual_seed(seed))
    model = nn.Linear(16, 1)
    data = torch.Generator().manual_seed(seed + 1000 * rank)
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    step = 0
    while step < steps:
        if rank == victim and step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(32, 16, generator=data)
        y = x @ truth + 0.01 * torch.randn(32, 1, generator=data)
        optimizer.zero_grad()
        try:
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
        except RuntimeError:
            failure = chorus_torch.failure()
            if failure is None or failure.culprit is None:
                raise
            world = dist.group.WORLD
            dead = dist.get_group_rank(world, failure.culprit)
            print(f"rank {rank}: step {step}: rank {failure.culprit} is gone ({failure.cause}); shrinking",
                  flush=True)
            group = dist.shrink_group([dead])
            ddp = DDP(model, process_group=group)
            continue
        optimizer.step()
        losses.append(float(loss.detach()))
        if step % log_every == 0:
            print(f"rank {rank}: step {step}: loss {losses[-1]:.5f} ({dist.get_world_size()} ranks)", flush=True)
        step += 1
    return losses, [p.detach().clone() for p in model.parameters()], dist.get_world_size()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--victim", type=int, default=1, help="the rank that dies")
    parser.add_argument("--die-at", type=int, default=40, help="the step it dies at (negative: never)")
    args = parser.parse_args()
    if not hasattr(dist, "shrink_group"):
        parser.error(f"torch {torch.__version__} has no torch.distributed.shrink_group (torch 2.15 and later)")
    dist.init_process_group("chorus")
    rank = dist.get_rank()
    losses, _, world = train(args.steps, args.victim, args.die_at)
    print(f"rank {rank}: done: {len(losses)} steps, loss {losses[0]:.5f} -> {losses[-1]:.5f}, "
          f"{world} ranks at the end")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
