"""Uneven inputs under DDP: `with model.join():` lets a rank that runs out of batches stop early.

Run:  torchrun --standalone --nproc-per-node=2 docs/snippets/join.py [--no-join]

Rank r trains on 3 + r batches, so rank 1 has one more than rank 0. Every backward of a DDP model
ends in a gradient all-reduce that all ranks must call. Inside join(), a rank that has finished
keeps answering those all-reduces with zero gradients until the others finish, and at the end every
rank gets the weights of the last rank to finish. With --no-join, rank 1's last all-reduce has no
partner. Rank 0 prints what each rank did as one JSON line.
"""

import json
import sys
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init_process_group: see the end of main()
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

LR = 0.1


def batches(rank):
    """Rank r's batches: 3 + r of them, 4 samples each (seeded, so the result can be worked out by
    hand)."""
    generator = torch.Generator().manual_seed(rank)
    return [
        (
            torch.randn(4, 3, generator=generator, dtype=torch.float64),
            torch.randn(4, 1, generator=generator, dtype=torch.float64),
        )
        for _ in range(3 + rank)
    ]


def make_model():
    torch.manual_seed(0)
    return nn.Linear(3, 1, dtype=torch.float64)


def main():
    use_join = "--no-join" not in sys.argv
    # --no-join hangs in an all-reduce: a 10 s timeout ends it (the default for gloo is 30 minutes).
    dist.init_process_group("gloo", timeout=timedelta(seconds=600 if use_join else 10))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = 0
    # divide_by_initial_world_size=True (the default): gradients are still divided by world_size
    # when some ranks have joined, so a step that only some ranks take counts for less.
    with model.join() if use_join else nullcontext():
        for inputs, targets in batches(rank):
            optimizer.zero_grad()
            F.mse_loss(
                model(inputs), targets
            ).backward()  # all-reduces the gradients: every rank, every step
            optimizer.step()
            steps += 1
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    ranks = [None] * world_size
    dist.all_gather_object(ranks, {"rank": rank, "steps": steps, "weights": weights})
    if rank == 0:
        print(json.dumps(ranks), flush=True)
    # The group, and gloo's worker threads, end with its last reference: a thread still letting go
    # of the last collective's tensors at interpreter shutdown aborts the process ("terminate called
    # without an active exception"). DDP holds the group: let go of it first. (So would
    # torch.distributed.nn's functions, for good, if imported after init_process_group, as DDP does:
    # their default group= is the group then. Hence the import at the top.)
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
