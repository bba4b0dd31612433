"""Seconds per microbatch (forward + backward) of each pipeline stage of BabyCNN, on one thread:
the t_stage of the ideal pipeline step time (m + p - 1) x t_stage. Prints a JSON line.

    python benchmarks/stage_time.py --stages 2 --microbatch 16 [--metrics stages.json]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import BabyCNN  # noqa: E402
from train_pippy import balanced_stages, block_flops  # noqa: E402  the script's split

parser = argparse.ArgumentParser()
parser.add_argument("--stages", type=int, default=2)
parser.add_argument("--microbatch", type=int, default=8)
parser.add_argument("--repeats", type=int, default=50)
parser.add_argument("--metrics", help="write the JSON line to this file too (the docs' exercises)")
args = parser.parse_args()
torch.set_num_threads(1)  # as each process of the pipeline runs: one thread

model = BabyCNN()
x = torch.randn(args.microbatch, 1, 28, 28)
seconds = []
for blocks in balanced_stages(block_flops(model, x[:1]), args.stages):
    stage = nn.Sequential(*(model.blocks[b] for b in blocks))
    inputs = x.clone().requires_grad_(
        blocks[0] > 0
    )  # later stages also compute the input's gradient
    for repeat in range(args.repeats + 5):
        if repeat == 5:  # after a warm-up
            start = time.perf_counter()
        output = stage(inputs)
        output.backward(torch.ones_like(output))
    seconds.append((time.perf_counter() - start) / args.repeats)
    x = stage(x).detach()  # the next stage's input
result = json.dumps(
    {"stages": args.stages, "microbatch": args.microbatch, "seconds_per_microbatch": seconds}
)
print(result)
if args.metrics:
    Path(args.metrics).write_text(result + "\n")
