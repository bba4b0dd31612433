"""Watching a run: rank 0's lines and bar, --log-dir's rows, traces, FLOPs, metrics."""

import csv
import io
import os
import resource
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

from plumbing import training
from plumbing.checkpoints import save_json, write_atomically
from plumbing.failures import UsageError, is_rank_0


def log(line):
    """Rank 0's lines, on stdout, above its progress bar."""
    if is_rank_0():
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()


class Progress:
    """Rank 0's bar (in a terminal) or lines; the loss curve, --log-dir's rows and the
    training clock, read only at logging steps (a GPU syncs)."""

    def __init__(self, plan, log_every, device, start_step=0, log_dir=None):
        self.total_steps, self.log_every = plan.total_steps, log_every
        self.global_batch_size = plan.global_batch_size
        self.start_step = self.step = start_step  # a resumed run counts on
        self.train_seconds, self.loss_curve, self.final_train_loss = 0.0, [], float("nan")
        self.whose = ""  # whose loss it is, from record_loss's label
        self.grad_norms = []  # [step, norm before clipping], if clipped
        self.test_loss = self.test_accuracy = None  # the last evaluation's
        self.device = device
        self.synchronize = torch.accelerator.synchronize if device.type != "cpu" else lambda: None
        shown = is_rank_0() and sys.stdout.isatty()
        options = dict(unit="step", file=sys.stdout, dynamic_ncols=True, disable=not shown)
        self.bar = tqdm(total=self.total_steps, initial=start_step, **options)
        self.rows = MetricsLog(log_dir, start_step) if log_dir and is_rank_0() else None

    def start_epoch(self, epoch):  # the clock restarts: epochs end at logging steps
        self.epoch = epoch
        self.bar.set_description(f"epoch {epoch + 1}", refresh=False)
        self.synchronize()
        self.started = time.perf_counter()

    def count_step(self):
        self.step += 1
        self.bar.update()  # no device wait: the bar reads the host's clock

    def is_logging_step(self, end_of_epoch):  # the loss is reduced and logged
        return self.step % self.log_every == 0 or self.step == self.total_steps or end_of_epoch

    def record_loss(self, loss, label, lr, norm=None):
        """A logging step's loss: bar, line, row; ``norm``: a tensor, before clipping."""
        grad_norm = None if norm is None else norm.item()
        self.synchronize()
        now = time.perf_counter()
        self.train_seconds, self.started = self.train_seconds + now - self.started, now
        self.final_train_loss, self.whose = loss, label.removeprefix("loss ")  # "(all ranks)"
        self.loss_curve.append([self.step, loss, self.train_seconds])
        norm = ""
        if grad_norm is not None:
            self.grad_norms.append([self.step, grad_norm])
            norm = f", grad norm {grad_norm:.4g}"
        rate = f"{self.rate():,.0f} samples/s"
        if self.bar.disable:
            step = f"step {self.step}/{self.total_steps}"
            log(f"{step}: {label} {loss:.4f}, lr {lr:.3g}{norm}, {rate}")
        self.bar.set_postfix_str(f"{label} {loss:.4f}, {rate}")
        if self.rows:
            row = {"step": self.step, "epoch": self.epoch + 1, "train_loss": loss, "lr": lr}
            self.rows.write(**row, grad_norm=grad_norm, samples_per_second=self.rate())

    def record_test(self, test_loss, test_accuracy):  # the epoch's line and row
        self.test_loss, self.test_accuracy = test_loss, test_accuracy
        train = f"train loss {self.final_train_loss:.4f} {self.whose}"
        test = f"test loss {test_loss:.4f}, test accuracy {test_accuracy:.2%}"
        log(f"epoch {self.epoch + 1}: step {self.step}, {train}, {test}")
        if self.rows:
            row = {"step": self.step, "epoch": self.epoch + 1, "test_loss": test_loss}
            self.rows.write(**row, test_accuracy=test_accuracy)

    def close(self):  # the bar stays on the screen
        self.bar.close()
        if self.rows:
            self.rows.close()
            self.rows = None

    def rate(self):  # samples per second of training
        samples = (self.step - self.start_step) * self.global_batch_size
        return samples / max(self.train_seconds, 1e-9)

    def summary(self):
        run = {"steps": self.step, "train_seconds": self.train_seconds}
        run |= {"samples_per_second": self.rate(), "final_train_loss": self.final_train_loss}
        run |= {"test_loss": self.test_loss, "test_accuracy": self.test_accuracy}
        return run | {"loss_curve": self.loss_curve, "grad_norms": self.grad_norms}


class MetricsLog:
    """--log-dir's metrics.csv and, if installed, TensorBoard's events. A resumed run keeps
    the rows to its checkpoint: no step twice, none missing."""

    FIELDS = ["step", "epoch", "train_loss", "lr", "grad_norm", "samples_per_second"]
    FIELDS += ["test_loss", "test_accuracy"]

    def __init__(self, directory, start_step):
        self.path = os.path.join(directory, "metrics.csv")
        rows = []
        if os.path.exists(self.path):  # a resumed run's
            with open(self.path, newline="") as file:
                rows = [row for row in csv.DictReader(file) if _kept(row, start_step)]
        text = io.StringIO()
        writer = csv.DictWriter(text, self.FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        write_atomically(self.path, lambda file: file.write(text.getvalue().encode()))
        self.file = open(self.path, "a", newline="")
        self.writer = csv.DictWriter(self.file, self.FIELDS, lineterminator="\n")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.events = None
            no_events = "no TensorBoard events (pip install tensorboard for them)"
            log(f"--log-dir: writing {self.path}; {no_events}")
        else:  # purge_step: drops the events after the checkpoint
            self.events = SummaryWriter(directory, purge_step=start_step + 1)

    def write(self, **row):  # flushed: a kill loses no row before the checkpoint
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


def _kept(row, start_step):  # whole, from before the checkpoint (or its step's training row)
    if None in row.values():
        return False
    step = int(row["step"])
    return step < start_step or (step == start_step and bool(row["train_loss"]))


class Profiler:
    """--profile-steps A:B: each rank's trace of steps A to B, in --log-dir."""

    def __init__(self, args, rank, device, start_step, total_steps):
        self.first, self.last = args.profile_steps or (0, -1)
        if args.profile_steps and not (args.log_dir and self.last <= total_steps):
            raise UsageError(
                f"--profile-steps {self.first}:{self.last} needs --log-dir, for the traces, and "
                f"steps from 1 to this run's {total_steps}"
            )
        if args.profile_steps and start_step >= self.first:  # an earlier attempt wrote them
            past = f"resumed at step {start_step}, past step {self.first}"
            log(f"--profile-steps: {past}: no new trace")
            self.first, self.last = 0, -1
        self.path, self.device = os.path.join(args.log_dir or "", f"trace-rank{rank}"), device
        activities = [torch.profiler.ProfilerActivity.CPU]
        gpu = device.type == "cuda"
        activities += [torch.profiler.ProfilerActivity.CUDA] if gpu else []
        self.profile = torch.profiler.profile(
            activities=activities, record_shapes=True, profile_memory=gpu, with_stack=gpu
        )
        self.after_step(start_step)

    def after_step(self, done):  # done: the optimizer steps finished
        if done == self.first - 1:
            self.profile.start()
        if done == self.last:
            self.profile.stop()
            self.profile.export_chrome_trace(self.path + ".json")
            if self.device.type == "cuda":
                self.profile.export_memory_timeline(self.path + "-memory.html", str(self.device))


def flops_per_sample(model, inputs):
    """FLOPs of a forward and a backward on one sample. What the model takes (its classes, its
    vocabulary) goes to ``training.Batches.expect``, which checks the data with it."""
    model.eval()  # BatchNorm takes one sample; no running statistic moves
    expected = {"inputs": list(inputs.shape[1:])}

    def ids_in(name, module, args):  # before the Embedding the inputs index: their ids fit it?
        if "embedding" not in expected and args and args[0] is inputs:
            expected["embedding"] = (name, module.num_embeddings)
            training.check_data(inputs, None, None, expected)

    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)]
    hooks = [m.register_forward_pre_hook(partial(ids_in, n)) for n, m in embeddings]
    with FlopCounterMode(display=False) as counter:
        logits = model(inputs)
        if not torch.is_tensor(logits) or logits.dim() < 2:  # refused before the first step
            raise UsageError(
                f"your model's forward returned {type(logits).__name__}, not one tensor of logits "
                "(..., classes): return only the logits (a Hugging Face model's output.logits)"
            )
        logits.sum().backward()
    for handle in hooks:  # (an error above ends the run)
        handle.remove()
    model.train()
    model.zero_grad(set_to_none=True)
    training.Batches.expect(expected | {"logits": list(logits.shape[1:])})
    return counter.get_total_flops()


def describe(args, plan, param_count, flops, unit="rank"):
    """The start line's figures; ``unit``: a data-parallel replica."""
    replicas = plan.global_batch_size // plan.samples_per_step
    top = ""
    if plan.top_lr < plan.peak_lr:  # a cosine, from step 0
        top = f"the cosine, from step 0, makes it {plan.top_lr:.3g} there; "
    return (
        f"batch {args.batch_size} per {unit} x grad-accum {args.grad_accum} x {replicas} "
        f"{unit}s = global batch {plan.global_batch_size}; peak lr {plan.peak_lr:g} after "
        f"{plan.warmup_steps} warmup steps; {top}{param_count:,} parameters; "
        f"{flops / 1e6:,.1f} MFLOPs a sample; {args.precision}"
        f"{', deterministic' if args.deterministic else ''}; {plan.dataset_name}; "
        f"{plan.total_steps} steps"
    )


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


def write_metrics(args, plan, progress, model, optimizer, flops, param_count, **run):
    """Collective: rank 0 gathers each rank's memory (and ``rank_info``), writes --metrics."""
    world_size, device = dist.get_world_size(), progress.device
    rank_info = run.pop("rank_info", {}) | memory(model, optimizer, device)
    ranks = [None] * world_size
    dist.all_gather_object(ranks, {"rank": dist.get_rank(), **rank_info})
    if is_rank_0():
        run |= {"global_batch_size": plan.global_batch_size, "peak_lr": plan.peak_lr}
        run |= {"param_count": param_count, "dataset": plan.dataset_name}
        run |= {"precision": args.precision, "world_size": world_size, "ranks": ranks}
        speed = throughput(flops, progress.rate(), world_size, device, args.precision)
        save_json({**run, **progress.summary(), **speed}, args.metrics)
