"""A checkpoint's save and resume with its SHA-256 check, against DCP's own save and load.

    torchrun --standalone --nproc-per-node=2 benchmarks/checkpoint_scale.py \\
        --gigabytes 1 --checkpoint-dir /tmp/ck_scale

FSDP2 (fully_shard) on gloo, CPU: a stack of 4096 x 4096 Linear layers with AdamW's two moments,
--gigabytes in all, half on each rank. Each repeat times, with a barrier before and after each:
DCP's own save (get_state_dict, dcp.save), Checkpoints.save (the same, the finite check, each rank
hashing the files it wrote, rank 0's checkpoint.json, rename and prune), DCP's own load
(get_state_dict, dcp.load, set_state_dict), Checkpoints.resume (each rank checking the files it
wrote, then the same load), and the hashing alone (each rank its file of DCP's checkpoint). The
medians and their ratios are printed (rank 0) as JSON; the folder is removed at the end.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plumbing import checkpoint_dir  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--gigabytes", type=float, default=1.0, help="weights and AdamW's moments")
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--checkpoint-dir", required=True, help="a folder of its own: removed after")
parser.add_argument("--metrics", help="write the figures as JSON")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, width = dist.get_rank(), 4096
layers = max(1, round(args.gigabytes * 1e9 / (12 * width * width)))  # fp32: weight and 2 moments
torch.manual_seed(0)
model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
for layer in model:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(2, width)).sum().backward()
optimizer.step()  # the moments exist
options = argparse.Namespace(checkpoint_dir=args.checkpoint_dir, keep_checkpoints=1)
vars(options).update(checkpoint_every=1, resume_from=None, init_from=None, optimizer="adamw")
plan = argparse.Namespace(dataset_name="synthetic", global_batch_size=64, peak_lr=1e-3)
plan.total_steps = args.repeats + 1
os.makedirs(args.checkpoint_dir, exist_ok=True)
checkpointer = checkpoint_dir.Checkpoints(options, plan, torch.device("cpu"))


def timed(work):
    dist.barrier()
    began = time.perf_counter()
    work()
    dist.barrier()
    return time.perf_counter() - began


def dcp_save(path):  # DCP's own way (its tutorial's): the state dicts, then dcp.save
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)


def dcp_load(path):  # get_state_dict, dcp.load in place, set_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def hash_mine(path):  # the check alone: this rank's files' SHA-256s
    names = [n for n in sorted(os.listdir(path)) if checkpoint_dir.checked_by(n, 2) == rank]
    checkpoint_dir.check_files(path, {n: [0, ""] for n in names}, names)


seconds = {"dcp_save": [], "save": [], "dcp_load": [], "resume": [], "hash": []}
try:
    for step in range(1, args.repeats + 1):
        plain = os.path.join(args.checkpoint_dir, f"dcp-{step}")
        seconds["dcp_save"].append(timed(lambda: dcp_save(plain)))
        seconds["save"].append(
            timed(lambda: checkpointer.save(step, 0, 0, model, optimizer, [torch.zeros(())]))
        )
        seconds["dcp_load"].append(timed(lambda: dcp_load(plain)))
        seconds["resume"].append(
            timed(lambda: checkpointer.resume(model, optimizer, lambda line: None))
        )
        seconds["hash"].append(timed(lambda: hash_mine(plain)))
        if rank == 0:
            shutil.rmtree(plain)
    saved = Path(args.checkpoint_dir) / f"step-{args.repeats}"
    result = {"ranks": dist.get_world_size(), "layers": layers}
    result["checkpoint_bytes"] = sum(f.stat().st_size for f in saved.iterdir())
    result |= {name: statistics.median(times) for name, times in seconds.items()}
    result["save_ratio"] = result["save"] / result["dcp_save"]
    result["resume_ratio"] = result["resume"] / result["dcp_load"]
    result["seconds_each"] = seconds
finally:
    dist.barrier()
    if rank == 0:
        shutil.rmtree(args.checkpoint_dir, ignore_errors=True)
    dist.destroy_process_group()
if rank == 0:
    print(json.dumps(result))
    if args.metrics:
        Path(args.metrics).write_text(json.dumps(result, indent=1) + "\n")
