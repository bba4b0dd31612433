"""How fast the GPT learns Tiny Shakespeare in one process: the scripts' recipe in a bare loop.

The same pieces the training scripts use (models/shakespeare.py's windows dealt by a
DistributedSampler of one replica, training.Batches, training.make_optimizer's fused AdamW,
training.Plan's warmup and cosine, training.evaluate on the whole validation split, counting
targets), without processes or a launcher. Prints a JSON line at each evaluation (step, training
seconds, validation loss) and a last one with the time to --target, for choosing the recipe the
scripts default to. One thread, as each of the issue's 2 CPU ranks has:

    OMP_NUM_THREADS=1 python benchmarks/gpt_learns.py                      # the default recipe
    OMP_NUM_THREADS=1 python benchmarks/gpt_learns.py --batch-size 12 --lr 1e-3 --steps 2000 \\
        --warmup-steps 100            # nanoGPT's CPU recipe's sizes (with core's AdamW and cosine)

Training seconds are wall seconds without the evaluations; "cpu_seconds" is the process's CPU
time over the same spans, which is what the training would take on a core of its own when the
machine is shared (the wall clock then counts other processes' turns too).

Measured (benchmarks/results/gpt_learns.json: torch 2.14.1, one thread of a 2-core Xeon shared at a
load of 8 to 10), before issue 62 made the GPT nanoGPT's model (its biases, an untied head). The
defaults: nanoGPT's CPU size (4 layers, 4 heads, 128 wide, context 64, then 0.82 M parameters),
batch 32, core's default AdamW (lr 3e-3, weight decay 0.01), 30 warmup steps, a cosine to 0 over 900
steps (1.84 epochs, 1.8 M tokens): validation loss 1.827 and 1.837 (seeds 0 and 1) in 121 and 123 s
of CPU, about 0.135 s a step. Shorter runs miss by a seed's variance: 700 steps gave 1.884 and 1.910
(94 and 98 s), 600 steps 1.937. nanoGPT's own figure for its recipe is about 1.88 after 2,000 steps
of batch 12 (1.5 M tokens).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import GPT, shakespeare
from models.gpt import generate
from plumbing import training

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
add = parser.add_argument
add("--n-layer", type=int, default=4)
add("--n-head", type=int, default=4)
add("--n-embd", type=int, default=128)
add("--block-size", type=int, default=64)
add("--batch-size", type=int, default=32, help="windows a step")
add("--steps", type=int, default=900, help="optimizer steps; the cosine reaches 0 at the last")
add("--lr", type=float, default=3e-3, help="peak learning rate")
add("--warmup-steps", type=int, default=30)
add("--weight-decay", type=float, default=0.01)
add("--max-grad-norm", type=float, help="clip the gradients' global norm (nanoGPT: 1.0)")
add("--eval-every", type=int, default=150, help="steps between evaluations (and one at the end)")
add("--target", type=float, default=1.9, help="the validation loss whose first reaching is timed")
add("--sample", type=int, default=200, help="characters the trained model writes at the end")
add("--seed", type=int, default=0)
add("--threads", type=int, default=1)
args = parser.parse_args()

torch.set_num_threads(args.threads)  # one, as each rank of the scripts' CPU runs
started = time.perf_counter()
device = torch.device("cpu")
train_set, val_set = shakespeare.datasets(
    shakespeare.split(shakespeare.read()), device, args.block_size
)
torch.manual_seed(args.seed)
model = GPT(train_set.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd)
sampler = DistributedSampler(
    train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed, drop_last=True
)
train_batches = training.Batches(train_set, args.batch_size, device, torch.float32)
val_batches = training.Batches(val_set, 64, device, torch.float32)
schedule = argparse.Namespace(
    lr=args.lr,
    optimizer="adamw",
    scale_lr=False,
    lr_schedule="cosine",
    batch_size=args.batch_size,
    grad_accum=1,
    epochs=1,
    max_steps=args.steps,
    warmup_steps=args.warmup_steps,
    weight_decay=args.weight_decay,
)
lr_at = training.Plan(schedule, args.steps * args.batch_size, 1, "shakespeare").lr
optimizer = training.make_optimizer(schedule, model.parameters())
print(
    json.dumps(
        {
            "parameters": sum(p.numel() for p in model.parameters()),
            "windows_per_epoch": len(train_set),
            "config": vars(args),
        }
    ),
    flush=True,
)


def evaluate():
    model.eval()
    loss_sum, _, count = training.evaluate(model, val_batches, 0, 1).tolist()  # over every target
    model.train()
    return loss_sum / count


step, epoch, train_seconds, cpu_seconds, reached, curve = 0, 0, 0.0, 0.0, None, []
setup_seconds = time.perf_counter() - started
while step < args.steps:
    sampler.set_epoch(epoch)
    indices = list(sampler)
    whole = len(indices) // args.batch_size * args.batch_size  # full batches, as drop_last
    for inputs, targets in train_batches(indices[:whole]):
        wall, cpu = time.perf_counter(), time.process_time()
        training.set_lr(optimizer, lr_at(step))
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if args.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        step += 1
        train_seconds += time.perf_counter() - wall
        cpu_seconds += time.process_time() - cpu
        if step % args.eval_every == 0 or step == args.steps:
            val_loss = evaluate()
            point = {
                "step": step,
                "epoch": round(step * args.batch_size / len(train_set), 3),
                "train_seconds": round(train_seconds, 1),
                "cpu_seconds": round(cpu_seconds, 1),
                "train_loss": round(loss.item(), 4),
                "val_loss": round(val_loss, 4),
            }
            curve.append(point)
            print(json.dumps(point), flush=True)
            if reached is None and val_loss <= args.target:
                reached = point
        if step == args.steps:
            break
    epoch += 1

text = ""
if args.sample:
    start = torch.zeros(1, 1, dtype=torch.int64)  # a newline, id 0
    generator = torch.Generator().manual_seed(args.seed)
    text = val_set.decode(generate(model, start, args.sample, generator=generator)[0, 1:])
print(
    json.dumps(
        {
            "reached_target": reached is not None,
            "target": args.target,
            "at": reached,
            "final_val_loss": curve[-1]["val_loss"],
            "train_seconds": round(train_seconds, 1),
            "cpu_seconds": round(cpu_seconds, 1),
            "setup_seconds": round(setup_seconds, 1),
            "wall_seconds": round(time.perf_counter() - started, 1),
            "sample": text,
        }
    ),
    flush=True,
)
