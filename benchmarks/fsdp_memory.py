r"""Peak tensor bytes per rank of an FSDP training step, by kind, counted tensor by tensor.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 benchmarks/fsdp_memory.py \
        --sharding grad-op --width 32

Wraps BabyCNN with train_fsdp.py's own make_mesh() and shard() (fully_shard per block, the same
reshard_after_forward and optional checkpoint_wrapper) and the scripts' AdamW, runs --steps
training steps on pre-made batches under torch's FSDPMemTracker (a TorchDispatchMode that follows
every tensor's storage) and prints, from rank 0, a JSON line with the largest rank's peak over the
last step, split into sharded and unsharded parameters, gradients, optimizer state, activations and
communication buffers, and the activations still held when forward ends. On a CPU this is the count
that shows what a layout holds: the process's resident memory also holds the PyTorch runtime and
the dataset (about 1 GB) and moves by more than these differences from run to run.
"""

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import premade  # noqa: E402

from models import BabyCNN  # noqa: E402
from train_fsdp import make_mesh, shard  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--sharding", choices=("full", "grad-op", "hybrid"), default="full")
parser.add_argument("--replicate-degree", type=int, default=2, help="hybrid only")
parser.add_argument("--activation-checkpointing", action="store_true")
parser.add_argument("--width", type=int, default=32)
parser.add_argument("--batch-size", type=int, default=8, help="per rank")
parser.add_argument(
    "--steps",
    type=int,
    default=2,
    help="the peak is the last step's (the first one creates AdamW's state)",
)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
args.compile, args.precision, args.cpu_offload = False, "fp32", False  # the scripts' defaults
mesh = make_mesh(args, torch.device("cpu"), world_size)
torch.manual_seed(0)
model = BabyCNN(width=args.width, device="meta")
shard(model, args, mesh)  # as train_fsdp.py shards it
model.to_empty(device="cpu")
model.reset_parameters()
optimizer = premade.optimizer(model.parameters())
batches = premade.batches(args.steps, args.batch_size, seed=rank)

tracker = FSDPMemTracker(model, optimizer)
tracker.track_inputs(batches[0])
with tracker:
    for step, (images, labels) in enumerate(batches):
        if step == args.steps - 1:
            tracker.reset_mod_stats()  # the peak of the last step only
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels)
        after_forward = tracker.get_tracker_snapshot("current")
        loss.backward()
        optimizer.step()
    peak = tracker.get_tracker_snapshot("peak")


def by_kind(snapshot):
    (per_device,) = snapshot.values()  # one device: the CPU
    return {str(kind).split(".")[-1].lower(): size for kind, size in per_device.items()}


mine = {"peak": by_kind(peak), "after_forward": by_kind(after_forward)}
everyone = [None] * world_size
dist.all_gather_object(everyone, mine)
if rank == 0:
    largest = max(everyone, key=lambda r: r["peak"]["total"])
    print(
        json.dumps(
            {
                "sharding": args.sharding,
                "mesh": list(mesh.shape),
                "activation_checkpointing": args.activation_checkpointing,
                "width": args.width,
                "batch_size": args.batch_size,
                "param_count": sum(p.numel() for p in model.parameters()),
                "peak_bytes_per_rank": [r["peak"]["total"] for r in everyone],
                **largest,
            }
        )
    )
del tracker, model, optimizer
# FSDP's reference cycles hold gloo's threads: left to the interpreter's exit, gloo may abort
gc.collect()
# torch 2.14's DTensor caches keep the mesh, and the mesh its group
getattr(mesh, "_pg_registry", {}).clear()
dist.destroy_process_group()
