"""A checkpoint's save and resume with its check, against DCP's own save and load.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 benchmarks/checkpoint_scale.py \\
        --gigabytes 1 --repeats 7 --checkpoint-dir /tmp/ck_scale

FSDP2 (fully_shard) on gloo, CPU: a stack of 4096 x 4096 Linear layers with AdamW's two moments,
--gigabytes in all, half on each rank. DCP's own save (get_state_dict, dcp.save) then load
(get_state_dict, dcp.load, set_state_dict), and the scripts': Checkpoints.save (the same, the
finite check, each rank checksumming the files it wrote, rank 0's checkpoint.json and rename) then
Checkpoints.resume (each rank checking the files it wrote, then the same load), in turn, --repeats
times each, each after the same work (a save right after another was slower). Each is timed with a
barrier before and after; so are the check alone (each rank its files), with the checksum and with
SHA-256 (format 4's), and rank 0 removing the checkpoint after them (what --keep-checkpoints'
prune does; the newest is kept here, so no save prunes). --cold drops the files from the page cache
before each load, resume and check, as on a node that did not write them. Rank 0 prints the
medians, their ratios, each run's seconds, torch's version and the load average as JSON; the
folder is removed at the end.
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
parser.add_argument("--repeats", type=int, default=7)
parser.add_argument("--cold", action="store_true", help="read from the disk, not the page cache")
parser.add_argument("--checkpoint-dir", required=True, help="a folder of its own: removed after")
parser.add_argument("--metrics", help="write the figures as JSON")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world_size, width = dist.get_rank(), dist.get_world_size(), 4096
layers = max(1, round(args.gigabytes * 1e9 / (12 * width * width)))  # fp32: weight and 2 moments
torch.manual_seed(0)
model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
for layer in model:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(2, width)).sum().backward()
optimizer.step()  # the moments exist
options = argparse.Namespace(checkpoint_dir=args.checkpoint_dir, keep_checkpoints=2 * args.repeats)
vars(options).update(checkpoint_every=1, resume_from=None, init_from=None, optimizer="adamw")
plan = argparse.Namespace(dataset_name="synthetic", global_batch_size=64, peak_lr=1e-3)
plan.total_steps = 2 * args.repeats + 1
os.makedirs(args.checkpoint_dir, exist_ok=True)
checkpointer = checkpoint_dir.Checkpoints(options, plan, torch.device("cpu"))
load_average = os.getloadavg()


def timed(work):
    dist.barrier()
    began = time.perf_counter()
    work()
    dist.barrier()
    return time.perf_counter() - began


def uncached(path):  # --cold: each file's pages dropped (written with fsync: none is dirty)
    if args.cold:
        for name in os.listdir(path):
            descriptor = os.open(os.path.join(path, name), os.O_RDONLY)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(descriptor)
    dist.barrier()


def dcp_save(path):  # DCP's own way (its tutorial's): the state dicts, then dcp.save
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)


def dcp_load(path):  # get_state_dict, dcp.load in place, set_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def save(path):  # the scripts' way: step-<N> in --checkpoint-dir
    checkpointer.save(int(path.rsplit("-", 1)[1]), 0, 0, model, optimizer, [torch.zeros(())])


def resume(path):  # the newest checkpoint: path
    checkpointer.resume(model, optimizer, lambda line: None)


WAYS = {
    1: [("dcp_save", dcp_save), ("dcp_load", dcp_load)],
    0: [("save", save), ("resume", resume)],
}


def check_mine(path, checksum):  # the check alone: this rank's files
    for name in sorted(os.listdir(path)):
        if checkpoint_dir.checked_by(name, world_size) == rank:
            checkpoint_dir._fingerprint(os.path.join(path, name), checksum)


seconds = {name: [] for name in ("dcp_save", "save", "dcp_load", "resume", "check")}
seconds |= {"check_sha256": [], "remove": []}
try:
    for way, ((_, write), (_, read)) in WAYS.items():  # the first calls' costs, untimed
        warm_up = os.path.join(args.checkpoint_dir, f"{'dcp-' * way}step-0")
        write(warm_up)
        read(warm_up)
    for step in range(1, 2 * args.repeats + 1):  # DCP's own, then the scripts', in turn
        path = os.path.join(args.checkpoint_dir, f"{'dcp-' * (step % 2)}step-{step}")
        (save_name, write), (load_name, read) = WAYS[step % 2]
        seconds[save_name].append(timed(lambda: write(path)))
        uncached(path)
        seconds[load_name].append(timed(lambda: read(path)))
        for checksum, name in ((checkpoint_dir.CHECKSUM, "check"), ("sha256", "check_sha256")):
            uncached(path)
            seconds[name].append(timed(lambda: check_mine(path, checksum)))
        size = sum(f.stat().st_size for f in Path(path).iterdir())  # .metadata's may vary
        seconds["remove"].append(timed(lambda: rank == 0 and shutil.rmtree(path)))
    result = {"ranks": world_size, "layers": layers, "cold": args.cold, "torch": torch.__version__}
    result["checkpoint_bytes"] = size  # the scripts' (step % 2 == 0), with checkpoint.json
    result |= {name: statistics.median(times) for name, times in seconds.items()}
    result["save_ratio"] = result["save"] / result["dcp_save"]
    result["resume_ratio"] = result["resume"] / result["dcp_load"]
    result["seconds_each"] = seconds
    result["load_average"] = [load_average, os.getloadavg()]  # 1, 5, 15 min: before, after
finally:
    dist.barrier()
    if rank == 0:
        shutil.rmtree(args.checkpoint_dir, ignore_errors=True)
    dist.destroy_process_group()
if rank == 0:
    print(json.dumps(result))
    if args.metrics:
        Path(args.metrics).write_text(json.dumps(result, indent=1) + "\n")
