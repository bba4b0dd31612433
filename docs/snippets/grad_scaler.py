"""fp16 mixed precision under DDP: autocast to float16, and a GradScaler that keeps the gradients in
range.

Run:  torchrun --standalone --nproc-per-node=2 docs/snippets/grad_scaler.py

On GPUs (NCCL) or CPUs (gloo; fp16 autocast on the CPU since torch 2.5). The scale starts at 2**24
on purpose, far too high: the first backwards overflow float16, each such step is skipped and the
scale halved, until the scaled gradients fit. Rank 0 prints each step's record as one JSON line per
rank.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init_process_group: see the end of main()
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = DDP(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).to(device),
        device_ids=[local_rank] if device.type == "cuda" else None,
    )
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1
    )  # weights, gradients, optimizer state: fp32
    # growth_interval: after this many steps without an overflow, the scale doubles (default 2000)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**24, growth_interval=1000)
    generator = torch.Generator().manual_seed(rank)  # each rank its own batches
    records = []
    for step in range(12):
        inputs = torch.randn(16, 32, generator=generator).to(device)
        labels = torch.randint(0, 10, (16,), generator=generator).to(device)
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):  # the forward (and the loss) only
            loss = F.cross_entropy(model(inputs), labels)
        scaler.scale(
            loss
        ).backward()  # backward of loss x scale; DDP all-reduces the scaled gradients
        scaler.unscale_(
            optimizer
        )  # divide by the scale now, if you clip: the clipping sees true gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)  # skips optimizer.step() if any gradient is inf or NaN
        scaler.update()  # after a skip: scale x 0.5; after growth_interval clean steps: x 2
        stepped = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        records.append(
            {
                "step": step,
                "scale": scale,
                "next_scale": scaler.get_scale(),
                "stepped": stepped,
                "loss": loss.item(),
            }
        )
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu().tolist()
    ranks = [None] * world_size
    dist.all_gather_object(ranks, {"rank": rank, "records": records, "weights": weights})
    if rank == 0:
        for entry in ranks:
            print(json.dumps(entry), flush=True)
    # The group, and gloo's worker threads, end with its last reference: a thread still letting go
    # of the last collective's tensors at interpreter shutdown aborts the process ("terminate called
    # without an active exception"). DDP holds the group: let go of it first. (So would
    # torch.distributed.nn's functions, for good, if imported after init_process_group, as DDP does:
    # their default group= is the group then. Hence the import at the top.)
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
