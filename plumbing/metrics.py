"""--metrics PATH: a JSON summary of the run, written by rank 0: losses, speed, MFU, each rank's
memory (opt-in: imported only when the flag is given, so a copy without this file refuses the flag
in one line)."""

import resource

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plumbing.failures import is_rank_0
from plumbing.outputs import save_json

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, SXM data sheets


def throughput(flops, samples_per_second, world_size, device, precision, gpu_name=None):
    """FLOP/s of all ranks and of one, and MFU: one GPU's FLOP/s over its bf16 peak."""
    if gpu_name is None:
        gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peaks = [value for gpu, value in PEAK_BF16.items() if gpu in gpu_name]
    peak = peaks[0] if peaks and precision == "bf16" else None
    achieved = flops * samples_per_second  # all ranks together
    per_gpu = achieved / world_size
    speed = {"flops_per_sample": flops, "flops_per_second": achieved}
    speed |= {"flops_per_second_per_gpu": per_gpu, "peak_flops_per_gpu": peak}
    return speed | {"mfu": per_gpu / peak if peak else None}


def memory(model, optimizer, device):
    """Bytes of parameters, gradients, optimizer state here (FSDP: a shard); the peak."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:  # the peak resident set: Linux says KiB
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"state_bytes": sum(t.nbytes for t in local), "peak_memory_bytes": peak}


def write(args, plan, progress, model, optimizer, flops, param_count, **run):
    """Collective: rank 0 gathers each rank's memory (and ``rank_info``), writes --metrics."""
    world_size, device = dist.get_world_size(), progress.device
    rank_info = run.pop("rank_info", {}) | memory(model, optimizer, device)
    ranks = [None] * world_size
    dist.all_gather_object(ranks, {"rank": dist.get_rank(), **rank_info})
    if is_rank_0():
        run |= {"global_batch_size": plan.global_batch_size, "peak_lr": plan.peak_lr}
        run |= {"param_count": param_count, "dataset": plan.dataset_name}
        run |= {"precision": args.precision, "world_size": world_size, "ranks": ranks}
        run |= {"steps": progress.step, "train_seconds": progress.train_seconds}
        run |= {"samples_per_second": progress.rate()}
        run |= {"final_train_loss": progress.final_train_loss, "test_loss": progress.test_loss}
        run |= {"test_accuracy": progress.test_accuracy, "loss_curve": progress.loss_curve}
        speed = throughput(flops, progress.rate(), world_size, device, args.precision)
        save_json({**run, "grad_norms": progress.grad_norms, **speed}, args.metrics)
