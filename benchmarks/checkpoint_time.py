"""Seconds to write one checkpoint of BabyCNN with AdamW, the scripts' own way, and its bytes.

    python benchmarks/checkpoint_time.py --width 16 --checkpoint-dir logs/ck_time

One process, a process group of one. The save is plumbing/checkpoint_dir.py's Checkpoints.save, as
every script calls it: DCP writes the weights and AdamW's two moments into .tmp-step-<N>, each rank
reads the files it wrote back for their checksums, rank 0 writes checkpoint.json and renames the
directory. A save is timed --repeats times after one untimed (the first pays for imports and file
creation); the median is reported with the bytes of the directory.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import BabyCNN  # noqa: E402
from plumbing import checkpoint_dir  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--width", type=int, default=16, help="BabyCNN's --width")
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--checkpoint-dir", required=True, help="where they go (the newest is kept)")
parser.add_argument("--metrics", help="write the figures as JSON")
args = parser.parse_args()

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    model = BabyCNN(width=args.width)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    optimizer.step()  # AdamW's moments exist from the first step on
    parameters = sum(p.numel() for p in model.parameters())
    options = argparse.Namespace(checkpoint_dir=args.checkpoint_dir, keep_checkpoints=1)
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    plan = argparse.Namespace(dataset_name="synthetic", global_batch_size=64, peak_lr=3e-3)
    plan.total_steps = args.repeats + 1
    checkpointer = checkpoint_dir.Checkpoints(options, plan, torch.device("cpu"))
    seconds = []
    for step in range(args.repeats + 1):
        began = time.perf_counter()
        checkpointer.save(step, 0, 0, model, optimizer, [torch.zeros(())])
        seconds.append(time.perf_counter() - began)
    saved = Path(args.checkpoint_dir) / f"step-{args.repeats}"
    files = sum(f.stat().st_size for f in saved.iterdir())
    result = {
        "width": args.width,
        "parameters": parameters,
        "checkpoint_bytes": files,
        "save_seconds": statistics.median(seconds[1:]),
        "seconds_each": seconds[1:],
    }
finally:
    dist.destroy_process_group()
print(json.dumps(result))
if args.metrics:
    Path(args.metrics).write_text(json.dumps(result, indent=1) + "\n")
