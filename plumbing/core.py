"""Flags, optimizer, lr, batches, evaluation, logs, files: what a script needs beside model and data. No collectives."""

import argparse
import csv
import errno
import io
import json
import math
import os
import resource
import shutil
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm


class UsageError(Exception):
    """Bad flags, a layout that cannot work, a run that cannot go on: one line from rank 0, exit code 2."""


class NodeError(UsageError):
    """A problem of one node (its GPUs), found before the process group exists: each such node says it."""


class Retryable(Exception):
    """A failure that may pass on a retry (a peer lost, a collective's error or timeout, an I/O error): one line,
    exit code 75 (EX_TEMPFAIL), which torchrun's restarts retry."""


BARS = []  # rank 0's progress bar (Progress): closed before a last line (an error, a stop), which goes below it


def say(line, rank=None):  # on stderr, from the process whose global (or given) rank is 0, on every torchrun attempt
    if (int(os.environ.get("RANK", "0")) if rank is None else rank) != 0:
        return False
    for bar in BARS:
        bar.close()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(line + (f" (torchrun restart {attempt})" if attempt else ""), file=sys.stderr, flush=True)
    return True


def log(line):  # rank 0's lines, on stdout, above its progress bar
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def step_range(text):  # argparse type: "A:B", optimizer steps from 1, A <= B
    first, _, last = text.partition(":")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise argparse.ArgumentTypeError(f"give two steps A:B, 1 <= A <= B, not {text!r}")
    return int(first), int(last)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + error on every rank: one line, once (hardening.run)
        raise UsageError(f"{message} (see --help)")

    class Formatter(argparse.ArgumentDefaultsHelpFormatter):
        def _get_help_string(self, action):  # "(default: X)" only where X says something, and only once
            quiet = action.default is None or "(default" in action.help
            return action.help if quiet else super()._get_help_string(action)


def number(kind, low, below=math.inf, above_low=False):  # argparse type: a finite kind from low (or above) to below
    def parse(text):
        if not (math.isfinite(value := kind(text)) and (low < value if above_low else low <= value) and value < below):
            raise argparse.ArgumentTypeError(f"must be {'above' if above_low else 'at least'} {low}"
                                             f"{f' and below {below}' if below < math.inf else ''}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse's "invalid int value: 'abc'"
    return parse


def parser(description, *more):  # the flags all three scripts share, then those ``more`` adds (the data's)
    add = (p := _Parser(description=description, formatter_class=_Parser.Formatter)).add_argument
    add("--epochs", type=number(int, 1), default=2, help="passes over the training set")
    add("--max-steps", type=number(int, 0), default=0, help="stop after this many optimizer steps (0: no limit)")
    add("--batch-size", type=number(int, 1), default=64, help="samples per micro-step on each data-parallel replica")
    add("--grad-accum", type=number(int, 1), default=1, help="micro-steps accumulated per optimizer step")
    add("--optimizer", choices=("adamw", "sgd"), default="adamw", help="fused AdamW, or SGD with momentum")
    add("--lr", type=number(float, 0, above_low=True), help="peak learning rate (default: 3e-3 adamw, 0.01 sgd)")
    add("--lr-schedule", choices=("cosine", "constant"), default="cosine", help="after the warmup: decay to 0, or hold")
    add("--momentum", type=number(float, 0, 1), default=0.9, help="SGD momentum")
    add("--weight-decay", type=number(float, 0), help="(default: 0.01 for adamw, 5e-4 for sgd)")
    add("--scale-lr", action="store_true", help="linear scaling rule: lr *= global_batch_size / base_batch_size")
    add("--base-batch-size", type=number(int, 1), default=64, help="the global batch size --lr was tuned for")
    add("--warmup-steps", type=number(int, 0), help="ramp the lr linearly over this many optimizer steps, at most half "
        "the run (default: 100, or a fifth of a run shorter than 500 steps)")
    add("--max-grad-norm", type=number(float, 0, above_low=True), help="clip gradients to this global L2 norm (logged)")
    add("--device", choices=("auto", "cuda", "cpu"), default="auto",
        help="auto: the GPU cuda:LOCAL_RANK when CUDA is available (NCCL), else the CPU (gloo)")
    add("--precision", choices=("fp32", "bf16", "fp64"), default="fp32", help="bf16: autocast forward; fp64: for tests")
    add("--compile", action="store_true", help="torch.compile: train_ddp.py the model, train_fsdp.py each block")
    add("--seed", type=int, default=0, help="same initial weights and data order on every rank")
    add("--workers", type=number(int, 0), default=0, help="DataLoader processes per rank (none: in the rank itself)")
    add("--log-every", type=number(int, 1), default=20, help="optimizer steps between all-reduced loss readings "
        "(a stop signal is honoured within about a second of training, whatever this is)")
    add("--no-eval", action="store_true", help="skip the test-set evaluation after each epoch (for measurements)")
    add("--checkpoint-dir", metavar="DIR", help="save checkpoints here, and resume from the newest one found there")
    add("--checkpoint-every", type=number(int, 1), default=100, help="steps between checkpoints (and one at the end)")
    add("--keep-checkpoints", type=number(int, 1), default=2, help="how many of the newest checkpoints to keep")
    add("--init-from", metavar="FILE", help="start from these weights (what --save or plumbing/consolidate.py "
        "writes; a .safetensors file too), with a fresh optimizer and schedule; a checkpoint in --checkpoint-dir "
        "wins over it")
    add("--resume-from", metavar="STEP", help="resume from this checkpoint, not the newest: step-<N> in "
        "--checkpoint-dir, or a path; the newer ones are moved aside (abandoned-step-<N>), and a rerun of the same "
        "command goes on from the newest of this branch")
    add("--save", metavar="PATH", help="write the final weights as a plain state dict (rank 0)")
    add("--metrics", metavar="PATH", help="write a JSON summary of the run (rank 0)")
    add("--log-dir", metavar="DIR", help="rank 0 appends a row per logging step and per evaluation to DIR/metrics.csv")
    add("--profile-steps", metavar="A:B", type=step_range, help="a torch.profiler trace of steps A to B per rank, "
        "in --log-dir")
    for add_more in more:
        add_more(p)
    return p


def lr_schedule(args, global_batch_size, total_steps):
    """The peak lr (--scale-lr: by the linear scaling rule), the warmup's steps (more than half the run: a UsageError),
    and the lr of step 0, 1, ...: a linear warmup to the peak, then constant or a cosine decay to 0 at total_steps."""
    peak = args.lr if args.lr is not None else {"adamw": 3e-3, "sgd": 0.01}[args.optimizer]
    peak *= global_batch_size / args.base_batch_size if args.scale_lr else 1
    warmup = min(100, total_steps // 5) if args.warmup_steps is None else args.warmup_steps
    if 2 * warmup > total_steps:
        raise UsageError(f"--warmup-steps {warmup} is more than half of this run's {total_steps} steps: the lr would "
                         f"stay below its peak {peak:g} for most of the run; give at most {total_steps // 2}")
    cosine = args.lr_schedule == "cosine"
    decay = (lambda s: 0.5 + 0.5 * math.cos(math.pi * s / total_steps)) if cosine else (lambda s: 1.0)
    return peak, warmup, lambda step: peak * min(1.0, (step + 1) / (warmup + 1)) * decay(step)


def make_optimizer(args, parameters):  # fused AdamW, foreach SGD (fused has no DTensor rule): not a Python loop
    decay = {"adamw": 0.01, "sgd": 5e-4}[args.optimizer] if args.weight_decay is None else args.weight_decay
    if args.optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=0.0, momentum=args.momentum, weight_decay=decay, foreach=True)
    return torch.optim.AdamW(parameters, lr=0.0, weight_decay=decay, fused=True)


def use_cuda(device_flag, local_rank):  # True for cuda:LOCAL_RANK; a NodeError if the node's ranks lack GPUs
    if device_flag == "cpu" or (device_flag == "auto" and not torch.cuda.is_available()):
        return False
    gpus, processes = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    if processes > gpus:  # device_count() honours CUDA_VISIBLE_DEVICES, nvidia-smi does not
        shown = f" (CUDA_VISIBLE_DEVICES={v})" if (v := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None else ""
        need = f"{processes} processes on this node need {processes} GPUs" if processes > 1 else "--device cuda: a GPU"
        way = f"start at most {gpus} per node (NPROC_PER_NODE={gpus})" if gpus else "use a machine with GPUs and CUDA"
        raise NodeError(f"{need}, but torch sees {gpus}{shown}: {way}, or train on the CPU with --device cpu")
    return True


def precision(args, device):  # the weights' dtype, and bf16 autocast (CPU and GPU alike) or nothing for the forward
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()
    return torch.float64 if args.precision == "fp64" else torch.float32, autocast


class Batches:
    """Called with indices: (inputs, labels) of map-style ``dataset`` there, ``batch_size`` at a time, on ``device``.
    A TensorDataset on the device is gathered by index; any other goes through one DataLoader (pinned memory on a GPU,
    ``workers`` forked once and kept: a fork while another loader's threads end can hang the child, CPython 3.11)."""

    def __init__(self, dataset, batch_size, device, dtype, workers=0, seed=0):
        self.dataset, self.batch_size, self.device, self.dtype = dataset, batch_size, device, dtype
        self.order = []  # the DataLoader's sampler: each call fills it, and the loader reads it from the start
        on_device = isinstance(dataset, TensorDataset) and not workers and dataset.tensors[0].device == device
        self.loader = None if on_device else DataLoader(
            dataset, batch_size, sampler=self.order, num_workers=workers, persistent_workers=workers > 0,
            pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(seed))

    def __call__(self, indices):
        if self.loader is None:
            indices = torch.as_tensor(indices, device=self.device)
            loaded = (self.dataset[indices[i : i + self.batch_size]] for i in range(0, len(indices), self.batch_size))
        else:
            self.order[:], loaded = indices, self.loader
        for inputs, labels in loaded:  # floating inputs in the model's dtype
            yield (inputs.to(self.device, self.dtype if inputs.is_floating_point() else None, non_blocking=True),
                   labels.to(self.device, non_blocking=True))


def flops_per_sample(model, dataset, device, dtype):
    """The FLOPs of a forward and a backward of ``model`` on one sample of ``dataset``, counted by FlopCounterMode (the
    matrix multiplies and convolutions), in eval mode: no running statistics change, and BatchNorm takes one sample."""
    inputs = next(Batches(dataset, 1, device, dtype)([0]))[0]
    model.eval()
    with FlopCounterMode(display=False) as counter:
        model(inputs).sum().backward()
    model.train()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense tensor-core FLOP/s, the SXM parts' data sheets


def throughput(flops, samples_per_second, world_size, device, precision, gpu_name=None):
    """The metrics' FLOP/s: all ranks' together and one rank's, and MFU: one GPU's FLOP/s over its peak, known for
    bf16 on the GPUs above (``gpu_name``: the device's own unless given)."""
    if gpu_name is None:
        gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peak = next((v for gpu, v in PEAK_BF16.items() if gpu in gpu_name), None) if precision == "bf16" else None
    achieved = flops * samples_per_second  # samples_per_second: the global batch's, all ranks together
    per_gpu = achieved / world_size
    return {"flops_per_sample": flops, "flops_per_second": achieved, "flops_per_second_per_gpu": per_gpu,
            "peak_flops_per_gpu": peak, "mfu": per_gpu / peak if peak else None}


@torch.no_grad()
def evaluate(forward, batches, rank, world_size, pipeline=False):
    """This replica's (loss sum, correct, count) of ``forward`` on its slice of ``batches.dataset``, to all-reduce,
    over targets: logits (..., C), labels (...), a target a sample or a token (a language model's).
    All run as many batches (FSDP gathers in each), padded with sample 0, uncounted; ``pipeline``: full batches."""
    size, count = batches.batch_size, len(batches.dataset)
    shard, longest = torch.arange(count).tensor_split(world_size)[rank].tolist(), -(-count // world_size)
    padded = shard + [0] * ((-(-longest // size) * size if pipeline else longest) - len(shard))
    totals = torch.zeros(3, dtype=torch.float64, device=batches.device)  # loss sum, correct, count
    for i, (inputs, labels) in enumerate(batches(padded)):
        logits = forward(inputs, labels) if pipeline else forward(inputs)
        real = len(shard[i * size : (i + 1) * size])  # 0 in a batch of padding alone
        if logits is not None and real:
            logits, labels = logits[:real].float().flatten(0, -2), labels[:real].flatten()
            totals += torch.stack([F.cross_entropy(logits, labels, reduction="sum").double(),
                                   (logits.argmax(dim=1) == labels).sum().double(),
                                   labels.new_tensor(labels.numel()).double()])
    return totals


def memory(model, optimizer, device):  # bytes of parameters, gradients, optimizer state here (FSDP: a shard); peak
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {"state_bytes": sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors),
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # peak resident set: Linux says KiB


def write_atomically(path, write, size=0):  # a temporary file beside path, renamed when complete: never half a file
    temporary = os.path.join(os.path.dirname(os.path.abspath(path)), f".tmp-{os.getpid()}-{os.path.basename(path)}")
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except (OSError, RuntimeError) as error:  # a full disk, a directory made read-only: one line, the old file kept
        if not isinstance(error, OSError) and not isinstance(error.__context__, OSError):
            raise
        size = max(size, os.path.getsize(temporary) if os.path.exists(temporary) else 0)
        os.remove(temporary) if os.path.exists(temporary) else None  # before the free space is measured
        raise UsageError(f"{path} was not written ({cannot_write(path, error, size)})") from None
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def cannot_write(path, error, needed=0):  # why a write failed; a full disk, with the room left (torch.save and DCP
    error = error.__context__ if isinstance(error.__context__, OSError) else error  # may hide its OSError)
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    if getattr(error, "errno", None) == errno.ENOSPC or free < needed:
        return f"the disk is full: {free / 1e6:.1f} MB are free there, this needs at least {needed / 1e6:.1f} MB"
    return getattr(error, "strerror", None) or " ".join(str(error).split())


def save_state_dict(state_dict, path):  # plain CPU tensors, which torch.load(weights_only=True) reads; finite ones
    state_dict = {name: tensor.detach().cpu() for name, tensor in state_dict.items()}
    if bad := next((n for n, t in state_dict.items() if t.is_floating_point() and not t.isfinite().all()), None):
        raise UsageError(f"{path} was not written: {bad} is not finite (training diverged); lower --lr or raise "
                         "--warmup-steps")
    write_atomically(path, lambda file: torch.save(state_dict, file), sum(t.nbytes for t in state_dict.values()))


def save_json(value, path):
    write_atomically(path, lambda file: file.write((json.dumps(value, indent=2) + "\n").encode()))


class Progress:
    """Rank 0's progress: in a terminal a bar redrawn in place (tqdm), elsewhere (a pipe, a SLURM log) a line at each
    logging step; --log-dir's rows; the loss curve ([step, loss, training seconds]) and the training clock: on a GPU
    it waits for the kernels, so it is read only at logging steps (evaluation excluded)."""

    def __init__(self, total_steps, global_batch_size, log_every, device, log, start_step=0, log_dir=None):
        self.total_steps, self.global_batch_size, self.log_every = total_steps, global_batch_size, log_every
        self.start_step = self.step = start_step  # a resumed run counts on from its checkpoint
        self.train_seconds, self.loss_curve, self.final_train_loss = 0.0, [], float("nan")
        self.grad_norms = []  # [step, the gradient norm before clipping] at each logging step, if clipped
        self.log, self.synchronize = log, torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        rank_zero = int(os.environ.get("RANK", "0")) == 0
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", file=sys.stdout, dynamic_ncols=True,
                        disable=not (rank_zero and sys.stdout.isatty()))
        BARS.append(self.bar)
        self.rows = MetricsLog(log_dir, start_step) if log_dir and rank_zero else None

    def start_epoch(self, epoch):  # the clock runs from here to each logging step: every epoch ends with one
        self.epoch = epoch
        self.bar.set_description(f"epoch {epoch + 1}", refresh=False)
        self.synchronize()
        self.started = time.perf_counter()

    def update(self, end_of_epoch):  # count a step; True when the loss window is to be reduced and logged
        self.step += 1
        self.bar.update()  # no wait for the device: the bar's clock reads the host's
        return self.step % self.log_every == 0 or self.step == self.total_steps or end_of_epoch

    def record_loss(self, loss, label, lr, grad_norm=None):  # a logging step's: the bar, the line, --log-dir's row
        self.synchronize()
        self.train_seconds, self.started = self.train_seconds + time.perf_counter() - self.started, time.perf_counter()
        self.final_train_loss = loss
        self.loss_curve.append([self.step, loss, self.train_seconds])
        self.grad_norms += [[self.step, grad_norm]] if grad_norm is not None else []
        norm = f", grad norm {grad_norm:.4g}" if grad_norm is not None else ""
        if self.bar.disable:
            self.log(f"step {self.step}/{self.total_steps}: {label} {loss:.4f}, lr {lr:.3g}{norm}, "
                     f"{self.rate():,.0f} samples/s")
        self.bar.set_postfix_str(f"{label} {loss:.4f}, {self.rate():,.0f} samples/s")
        if self.rows:
            self.rows.write(step=self.step, epoch=self.epoch + 1, train_loss=loss, lr=lr, grad_norm=grad_norm,
                            samples_per_second=self.rate())

    def record_test(self, test_loss, test_accuracy):  # the evaluation's row in --log-dir
        if self.rows:
            self.rows.write(step=self.step, epoch=self.epoch + 1, test_loss=test_loss, test_accuracy=test_accuracy)

    def close(self):  # the bar's last state stays on the screen; the CSV and TensorBoard's events are closed
        self.bar.close()
        if self.rows:
            self.rows.close()
            self.rows = None

    def rate(self):  # samples per second of training
        return (self.step - self.start_step) * self.global_batch_size / max(self.train_seconds, 1e-9)

    def summary(self):
        return {"steps": self.step, "train_seconds": self.train_seconds, "samples_per_second": self.rate(),
                "final_train_loss": self.final_train_loss, "loss_curve": self.loss_curve, "grad_norms": self.grad_norms}


class MetricsLog:
    """--log-dir's metrics.csv: a row per logging step (training) and per evaluation (test), flushed as written. A
    resumed run keeps the rows up to its checkpoint's step (not that step's evaluation, which it runs again) and goes
    on: no step twice, none missing. TensorBoard's events beside it where tensorboard is installed."""

    FIELDS = ["step", "epoch", "train_loss", "lr", "grad_norm", "samples_per_second", "test_loss", "test_accuracy"]

    def __init__(self, directory, start_step):
        self.path = os.path.join(directory, "metrics.csv")
        rows = []
        if os.path.exists(self.path):  # a resumed run's: the rows up to its checkpoint, whole rows only
            with open(self.path, newline="") as file:
                rows = [row for row in csv.DictReader(file) if None not in row.values() and (
                    int(row["step"]) < start_step or (int(row["step"]) == start_step and row["train_loss"]))]
        text = io.StringIO()
        writer = csv.DictWriter(text, self.FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        write_atomically(self.path, lambda file: file.write(text.getvalue().encode()))
        self.file = open(self.path, "a", newline="")
        self.writer = csv.DictWriter(self.file, self.FIELDS, lineterminator="\n")
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.events = SummaryWriter(directory, purge_step=start_step + 1)  # drops events after the checkpoint
        except ImportError:
            self.events = None
            log(f"--log-dir: writing {self.path}; no TensorBoard events (pip install tensorboard for them)")

    def write(self, **row):  # flushed: a killed run loses no row before its checkpoint
        self.writer.writerow(row)
        self.file.flush()
        if self.events:
            for name, value in row.items():
                if name not in ("step", "epoch") and value is not None:
                    self.events.add_scalar(name, value, row["step"])
            self.events.flush()

    def close(self):
        self.file.close()
        if self.events:
            self.events.close()


class Profiler:
    """--profile-steps A:B: torch.profiler from step A to step B, then each rank writes its trace (Chrome or Perfetto
    JSON) to --log-dir/trace-rank<R>.json, and on a GPU its memory timeline beside it (-memory.html)."""

    def __init__(self, args, rank, device, start_step, total_steps):
        self.first, self.last = args.profile_steps or (0, -1)
        if args.profile_steps and not (args.log_dir and self.last <= total_steps):
            raise UsageError(f"--profile-steps {self.first}:{self.last} needs --log-dir, for the traces, and steps "
                             f"from 1 to this run's {total_steps}")
        if args.profile_steps and start_step >= self.first:  # resumed past A: an earlier attempt wrote the traces
            if rank == 0:
                log(f"--profile-steps: resumed at step {start_step}, past step {self.first}: no new trace")
            self.first, self.last = 0, -1
        self.path, self.device = os.path.join(args.log_dir or "", f"trace-rank{rank}"), device
        gpu = [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
        self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, *gpu],
                                              record_shapes=True, profile_memory=bool(gpu), with_stack=bool(gpu))
        self.after_step(start_step)

    def after_step(self, done):  # done: the optimizer steps finished
        if done == self.first - 1:
            self.profile.start()
        if done == self.last:
            self.profile.stop()
            self.profile.export_chrome_trace(self.path + ".json")
            if self.device.type == "cuda":
                self.profile.export_memory_timeline(self.path + "-memory.html", str(self.device))
