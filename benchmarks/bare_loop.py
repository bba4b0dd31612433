r"""The compute limit for train_ddp.py on one process: forward, backward and step over pre-made
batches of the same model and data, and nothing else. Prints a JSON line with samples/s and the time
of a step.

    OMP_NUM_THREADS=1 python benchmarks/bare_loop.py --steps 300 --batch-size 64
    # the host's cost per step
    OMP_NUM_THREADS=1 python benchmarks/bare_loop.py --steps 2000 --batch-size 1 [--ddp]
    python benchmarks/bare_loop.py --device cuda --steps 1000 --batch-size 512 \
        [--precision bf16] [--compile] [--ddp]

--ddp wraps the model in DDP on a process group of one, which train_ddp.py skips on one process: the
difference from the same command without it is what DDP's hooks cost a step when there is nothing to
average.
"""

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import premade  # noqa: E402

from models import BabyCNN  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--width", type=int, default=1)
parser.add_argument("--device", default="cpu", help="cpu or cuda")
parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
parser.add_argument(
    "--compile",
    action="store_true",
    help="compile the whole model, as train_ddp.py's --compile does",
)
parser.add_argument(
    "--ddp", action="store_true", help="wrap the model in DDP on a process group of one"
)
parser.add_argument(
    "--warmup",
    type=int,
    default=None,
    help="steps before the clock starts (default 30 on a GPU, 0 on a CPU)",
)
args = parser.parse_args()

device = torch.device(args.device)
synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
# At most 64 distinct batches, made before the clock starts and cycled: no data work in the loop.
batches = [
    (x.to(device), y.to(device))
    for x, y in premade.batches(min(args.steps, 64), args.batch_size, seed=0)
]
torch.manual_seed(0)
model = BabyCNN(width=args.width, device=device)
if args.compile:  # as train_ddp.py: CUDA graphs on a GPU
    model.compile(mode="reduce-overhead" if device.type == "cuda" else None)
optimizer = premade.optimizer(model.parameters())
if args.ddp:
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
    model = DDP(
        model,
        device_ids=[device.index or 0] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
autocast = (
    torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()
)


def train(steps):
    for step in range(steps):
        x, y = batches[step % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()


train(args.warmup if args.warmup is not None else (30 if device.type == "cuda" else 0))
synchronize()
start = time.perf_counter()
train(args.steps)
synchronize()  # the clock stops when the GPU has done the work, not when the last kernel was queued
seconds = time.perf_counter() - start
print(
    json.dumps(
        {
            "samples_per_second": args.steps * args.batch_size / seconds,
            "seconds": seconds,
            "microseconds_per_step": 1e6 * seconds / args.steps,
        }
    )
)
if args.ddp:
    dist.destroy_process_group()
