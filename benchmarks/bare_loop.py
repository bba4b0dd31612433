"""The compute limit for train_ddp.py on one process: forward, backward and step over pre-made
batches of the same model and data, and nothing else. Prints a JSON line with samples/s.

    OMP_NUM_THREADS=1 python benchmarks/bare_loop.py --steps 300 --batch-size 64
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import premade  # noqa: E402
from models import BabyCNN  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--width", type=int, default=1)
args = parser.parse_args()

batches = premade.batches(args.steps, args.batch_size, seed=0)  # no data work in the loop
torch.manual_seed(0)
model = BabyCNN(width=args.width)
optimizer = premade.optimizer(model.parameters())
start = time.perf_counter()
for x, y in batches:
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
seconds = time.perf_counter() - start
print(json.dumps({"samples_per_second": args.steps * args.batch_size / seconds, "seconds": seconds}))
