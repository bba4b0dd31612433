"""Where a DDP step's time goes beyond compute, on one machine. Prints a JSON line (rank 0).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 benchmarks/ddp_sync.py --steps 300

The same model, optimizer and batch as train_ddp.py, with pre-made batches. Per step it records
when each rank's last gradient is ready (DDP's all-reduce of the single bucket starts then) and when
backward returns (the all-reduce is done). The ranks share one clock (time.perf_counter is
CLOCK_MONOTONIC on Linux), so the times compare across processes of one machine, not across nodes.
  compute_ms         forward + backward up to the last gradient, per rank
  wait_ms            how long a rank's gradients wait for the slower rank's: mean of (latest - own)
  allreduce_ms       from the slower rank's last gradient to the end of backward: the exchange
  idle_allreduce_ms  the same all-reduce (all the gradients, and 1 float) between idle ranks
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before the group: its functions' group= defaults, imported later, hold it
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import premade  # noqa: E402

from models import BabyCNN  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--warmup", type=int, default=20, help="first steps left out of the figures")
args = parser.parse_args()


def main():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = premade.batches(args.steps, args.batch_size, seed=rank)
    torch.manual_seed(0)
    model = DDP(BabyCNN())
    optimizer = premade.optimizer(model.parameters())
    last_gradient = [0.0]
    for parameter in model.parameters():  # registered after DDP's own hooks, so they run after them
        parameter.register_post_accumulate_grad_hook(
            lambda _: last_gradient.__setitem__(0, time.perf_counter())
        )

    times = []  # per step: start, last gradient ready, backward returned
    dist.barrier()
    for images_batch, labels_batch in batches:
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        F.cross_entropy(model(images_batch), labels_batch).backward()
        times.append((start, last_gradient[0], time.perf_counter()))
        optimizer.step()

    def idle_allreduce_ms(numel, repeats=100):
        tensor = torch.zeros(numel)
        dist.barrier()
        begin = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(tensor)
        return (time.perf_counter() - begin) / repeats * 1000

    idle = {
        "gradients": idle_allreduce_ms(sum(p.numel() for p in model.parameters())),
        "one_float": idle_allreduce_ms(1),
    }
    everyone = [None] * world_size
    dist.all_gather_object(everyone, times)
    if rank == 0:
        steps = range(min(args.warmup, len(times) // 2), len(times))
        latest = [max(ranks[i][1] for ranks in everyone) for i in steps]
        compute = [ranks[i][1] - ranks[i][0] for ranks in everyone for i in steps]
        wait = [latest[k] - ranks[i][1] for ranks in everyone for k, i in enumerate(steps)]
        exchange = [ranks[i][2] - latest[k] for ranks in everyone for k, i in enumerate(steps)]
        print(
            json.dumps(
                {
                    "world_size": world_size,
                    "compute_ms": statistics.mean(compute) * 1000,
                    "wait_ms": statistics.mean(wait) * 1000,
                    "allreduce_ms": statistics.mean(exchange) * 1000,
                    "idle_allreduce_ms": idle["gradients"],
                    "idle_allreduce_one_float_ms": idle["one_float"],
                }
            )
        )


dist.init_process_group("gloo")
try:
    # its DDP model goes with it: nothing else holds the group, and destroy ends gloo's threads
    main()
finally:
    dist.destroy_process_group()
