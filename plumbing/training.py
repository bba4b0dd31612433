"""Training arithmetic and flags: shared flags, the step plan and lr, batches, evaluation."""

import argparse
import importlib.util
import math
import os
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from plumbing.failures import NodeError, UsageError, input_error

# Features a default run does not use, each a file of plumbing/ imported where its flag is used
# (nanoGPT's `if wandb_log: import wandb`): a copy carries only the files it uses. {dest: file}
OPT_IN = {f: f for f in ["checkpoint_dir", "init_from", "log_dir", "profile_steps", "metrics"]}
OPT_IN |= {"resume_from": "checkpoint_dir", "deterministic": "deterministic"}
START = {"step": 0, "epoch": 0, "samples_into_epoch": 0}  # of a run that resumes nothing


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # not usage on every rank: one line, once
        raise UsageError(f"{message} (see --help)")

    def parse_known_args(self, args=None, namespace=None):  # twice: for --model's defaults
        first = super().parse_known_args(args)[0]  # with the plain defaults
        namespace = namespace or argparse.Namespace()
        for flag, defaults in self.presets.items():  # {dest: {value: {dest: default}}}
            vars(namespace).update(defaults.get(getattr(first, flag), {}))  # a flag given wins
        namespace, rest = super().parse_known_args(args, namespace)
        for flag in [f for f in OPT_IN if getattr(namespace, f, None)]:  # a copy may lack its file
            if importlib.util.find_spec(f"plumbing.{OPT_IN[flag]}") is None:  # now, not later
                raise UsageError(
                    f"--{flag.replace('_', '-')} needs plumbing/{OPT_IN[flag]}.py, which "
                    "this copy lacks: copy that file from the project into your plumbing/"
                )
        return namespace, rest


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # "(default: X)" once, where X says something
        quiet = action.default is None or "(default" in action.help
        return action.help if quiet else super()._get_help_string(action)


def number(kind, low, below=math.inf, above_low=False):
    """An argparse type: a finite ``kind`` from ``low`` (or above it) to below ``below``."""

    def parse(text):
        value = kind(text)
        if math.isfinite(value) and (low < value if above_low else low <= value) and value < below:
            return value
        least = "above" if above_low else "at least"
        upper = f" and below {below}" if below < math.inf else ""
        raise argparse.ArgumentTypeError(f"must be {least} {low}{upper}, got {text}")

    parse.__name__ = kind.__name__  # argparse's "invalid int value: 'abc'"
    return parse


def step_range(text):
    """An argparse type: "A:B", optimizer steps from 1, A <= B."""
    first, _, last = text.partition(":")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise argparse.ArgumentTypeError(f"give two steps A:B, 1 <= A <= B, not {text!r}")
    return int(first), int(last)


def parser(description, more=None):
    """The flags all scripts share, then those ``more`` adds (the data's)."""
    p = _Parser(description=description, formatter_class=_Help)
    add, positive = p.add_argument, number(float, 0, above_low=True)
    add("--epochs", type=number(int, 1), default=2, help="passes over the training set")
    add("--max-steps", type=number(int, 0), default=0, help="at most this many steps (0: no limit)")
    add("--batch-size", type=number(int, 1), default=64, help="samples per micro-step per replica")
    add("--grad-accum", type=number(int, 1), default=1, help="micro-steps per optimizer step")
    add("--optimizer", choices=("adamw", "sgd"), default="adamw", help="fused AdamW, or SGD")
    add("--lr", type=positive, help="peak learning rate (default: 3e-3 adamw, 0.01 sgd)")
    add("--lr-schedule", choices=("cosine", "constant"), default="cosine", help="after the warmup")
    add("--momentum", type=number(float, 0, 1), default=0.9, help="SGD momentum")
    add("--weight-decay", type=number(float, 0), help="(default: 0.01 adamw, 5e-4 sgd)")
    add("--scale-lr", action="store_true", help="lr *= global_batch_size / base_batch_size")
    add("--base-batch-size", type=number(int, 1), default=64, help="the global batch --lr fits")
    add("--warmup-steps", type=number(int, 0), help="linear warmup steps (default: 100 or a fifth)")
    add("--max-grad-norm", type=positive, help="clip gradients to this global L2 norm (logged)")
    add("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: this rank's GPU")
    add("--precision", choices=("fp32", "bf16", "fp64"), default="fp32", help="bf16: autocast")
    add("--compile", action="store_true", help="torch.compile the model (DDP) or each block (FSDP)")
    add("--deterministic", action="store_true", help="bitwise reruns on a GPU (cost: unmeasured)")
    add("--seed", type=int, default=0, help="initial weights, data order; + rank: dropout masks")
    add("--workers", type=number(int, 0), default=0, help="DataLoader processes per rank")
    add("--log-every", type=number(int, 1), default=20, help="steps between all-reduced losses")
    add("--no-eval", action="store_true", help="skip the test-set evaluation after each epoch")
    add("--checkpoint-dir", metavar="DIR", help="save checkpoints here; resume from the newest")
    add("--checkpoint-every", type=number(int, 1), default=100, help="steps between checkpoints")
    add("--keep-checkpoints", type=number(int, 1), default=2, help="how many of the newest to keep")
    add("--init-from", metavar="FILE", help="start from these weights, with a fresh optimizer")
    add("--resume-from", metavar="STEP", help="resume from step-<N> or a path, not the newest")
    add("--save", metavar="PATH", help="write the final weights as a plain state dict (rank 0)")
    add("--metrics", metavar="PATH", help="write a JSON summary of the run (rank 0)")
    add("--log-dir", metavar="DIR", help="rank 0 appends a row per logging step to metrics.csv")
    add("--profile-steps", metavar="A:B", type=step_range, help="a trace of steps A to B per rank")
    p.presets = more(p) if more else {}  # the defaults a flag's value sets (--model's)
    return p


class Plan:
    """A run's steps, global batch and lr: a linear warmup times, for a cosine schedule, a cosine
    from step 0: ``top_lr``, at the warmup's end, is below the peak (0.97 x for 100 of 1,000)."""

    def __init__(self, args, samples, replicas, dataset_name, replica="ranks"):
        self.samples_per_step = args.batch_size * args.grad_accum  # per replica
        self.steps_per_epoch = samples // self.samples_per_step
        if self.steps_per_epoch == 0:
            raise UsageError(
                f"--batch-size {args.batch_size} x --grad-accum {args.grad_accum} is more than "
                f"the {samples} samples each of the {replicas} {replica} gets from {dataset_name}; "
                "make it smaller"
            )
        self.global_batch_size = batch = self.samples_per_step * replicas
        self.dataset_name = dataset_name
        whole = self.steps_per_epoch * args.epochs
        self.total_steps = total = min(args.max_steps or whole, whole)
        self.epochs = -(-total // self.steps_per_epoch)
        self.peak_lr, self.warmup_steps = peak_and_warmup(args, batch, total)
        self.cosine = args.lr_schedule == "cosine"

    def lr(self, step):  # of the step alone: a resumed run goes on exactly
        decay = 0.5 + 0.5 * math.cos(math.pi * step / self.total_steps) if self.cosine else 1.0
        return self.peak_lr * min(1.0, (step + 1) / (self.warmup_steps + 1)) * decay

    @property
    def top_lr(self):  # the highest lr used: the warmup's end
        return self.lr(self.warmup_steps)


def peak_and_warmup(args, global_batch_size, total_steps):
    """The peak lr (--scale-lr: the linear scaling rule) and the warmup's steps."""
    peak = args.lr if args.lr is not None else {"adamw": 3e-3, "sgd": 0.01}[args.optimizer]
    peak *= global_batch_size / args.base_batch_size if args.scale_lr else 1
    warmup = min(100, total_steps // 5) if args.warmup_steps is None else args.warmup_steps
    if 2 * warmup > total_steps:
        raise UsageError(
            f"--warmup-steps {warmup} is more than half of this run's {total_steps} steps: the lr "
            f"would stay below its peak {peak:g} for most of the run; "
            f"give at most {total_steps // 2}"
        )
    return peak, warmup


def set_lr(optimizer, lr):  # the schedule's, on every parameter group
    for group in optimizer.param_groups:
        group["lr"] = lr


def make_optimizer(args, parameters):
    """Fused AdamW, or foreach SGD (fused has no DTensor rule): no Python loop."""
    decay = args.weight_decay
    decay = {"adamw": 0.01, "sgd": 5e-4}[args.optimizer] if decay is None else decay
    if args.optimizer == "sgd":
        return torch.optim.SGD(
            parameters, lr=0.0, momentum=args.momentum, weight_decay=decay, foreach=True
        )
    return torch.optim.AdamW(parameters, lr=0.0, weight_decay=decay, fused=True)


def pick_device(args, local_rank):
    """--device: this rank's accelerator (LOCAL_RANK) or the CPU, with --deterministic's kernels
    if given; one line if too few."""
    if args.deterministic:  # before any kernel runs
        from plumbing import deterministic

        deterministic.enable()
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if args.device == "cpu" or (args.device == "auto" and accelerator is None):
        return torch.device("cpu")
    count = torch.accelerator.device_count()  # honours CUDA_VISIBLE_DEVICES; nvidia-smi does not
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    if processes > count:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        if processes > 1:
            need = f"{processes} processes on this node need {processes} GPUs"
        else:
            need = "--device cuda: a GPU"
        if count:
            way = f"start at most {count} per node (NPROC_PER_NODE={count})"
        else:
            way = "use a machine with GPUs and CUDA"
        raise NodeError(
            f"{need}, but torch sees {count}{shown}: {way}, or train on the CPU with --device cpu"
        )
    torch.accelerator.set_device_index(local_rank)
    return torch.device(accelerator.type, local_rank)


def dtype_of(args):  # the weights' dtype: bf16 runs fp32 weights under autocast
    return torch.float64 if args.precision == "fp64" else torch.float32


def autocast(args, device):  # for the forward, CPU and GPU alike
    bf16 = args.precision == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


class Batches:
    """Indices to (inputs, labels) batches on ``device``: by index from a TensorDataset there,
    else one DataLoader, forked once (3.11 can hang a fork as another loader's threads end).
    Once the model is known (``expect``), its data is checked against it: a TensorDataset whole,
    at once, and every batch a DataLoader draws, on the host before it moves (no GPU sync)."""

    def __init__(self, dataset, batch_size, device, dtype, workers=0, seed=0):
        self.dataset, self.batch_size, self.device, self.dtype = dataset, batch_size, device, dtype
        self.order = []  # the DataLoader's sampler: each call fills it
        gather = isinstance(dataset, TensorDataset) and dataset.tensors[0].device == device
        self.expected = None  # what the model takes, for each batch drawn (expect)
        self.loader = None
        if workers or not gather:
            self.loader = DataLoader(
                _Reads(dataset),
                batch_size,
                sampler=self.order,
                num_workers=workers,
                persistent_workers=workers > 0,
                pin_memory=device.type == "cuda",
                generator=torch.Generator().manual_seed(seed),
            )

    def __call__(self, indices):
        if self.loader is None:
            indices = torch.as_tensor(indices, device=self.device)
            size = self.batch_size
            loaded = (self.dataset[indices[i : i + size]] for i in range(0, len(indices), size))
        else:
            self.order[:], loaded = indices, self.loader
        for start, (inputs, labels) in zip(range(0, len(indices), self.batch_size), loaded):
            if self.expected and labels.device.type == "cpu":  # as drawn, on the host
                rows = self.order[start : start + len(labels)]
                check_data(inputs, labels, rows, self.expected, self.name)
            dtype = self.dtype if inputs.is_floating_point() else None  # floats: the model's
            inputs = inputs.to(self.device, dtype, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            yield inputs, labels

    def expect(self, expected, name):
        """What the model takes (``check_data_fits``); ``name`` (the training set, the test set) is
        said with a sample's index."""
        self.name = name
        if not isinstance(self.dataset, TensorDataset):
            self.expected = expected
            return
        count, chunk = len(self.dataset), 8192  # a chunk's copy: 25 MB of MNIST
        for start in range(0, count, chunk):
            rows = range(start, min(start + chunk, count))
            index = torch.arange(rows.start, rows.stop, device=self.dataset.tensors[0].device)
            inputs, labels = self.dataset[index]
            check_data(inputs, labels, rows, expected, name)


class _Reads(Dataset):
    """``dataset`` as a DataLoader reads it: an OSError is the user's input (input_error)."""

    def __init__(self, dataset):  # no __len__: a DataLoader with a sampler reads none
        self.dataset = dataset

    def __getitem__(self, index):  # a read's OSError names no file: the sample is named
        return self._read(self.dataset.__getitem__, index, f"sample {index}")

    def __getitems__(self, indices):  # a batch at once, where the dataset reads so
        if read := getattr(self.dataset, "__getitems__", None):
            return self._read(read, indices, f"a batch from sample {indices[0]}")
        return [self[i] for i in indices]

    def _read(self, read, index, what):
        try:
            return read(index)
        except OSError as error:
            raise input_error(error, f"the data ({what})") from None


def check_data_fits(model, train_batches, test_batches):
    """Bad data refused in one line before the first step, where it would be a device-side assert
    on a GPU, an IndexError or a traceback on a CPU. The model runs on the first test sample (its
    token ids checked before its Embedding reads them), its logits say what it takes, and each
    Batches checks its data against that (``expect``)."""
    inputs = next(test_batches([0]))[0]
    expected = {"inputs": list(inputs.shape[1:])}
    given = inputs.to("meta") if next(model.parameters()).is_meta else inputs  # shapes alone

    def ids_in(name, module, args):  # before the Embedding the inputs index: their ids fit it?
        if "embedding" not in expected and args and args[0] is given:
            expected["embedding"] = (name, module.num_embeddings)
            check_data(inputs, None, None, expected)

    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)]
    hooks = [m.register_forward_pre_hook(partial(ids_in, n)) for n, m in embeddings]
    model.eval()  # BatchNorm takes one sample; no running statistic moves
    with torch.no_grad():
        logits = model(given)
    for handle in hooks:  # (an error above ends the run)
        handle.remove()
    model.train()
    if not torch.is_tensor(logits) or logits.dim() < 2:
        raise UsageError(
            f"your model's forward returned {type(logits).__name__}, not one tensor of logits "
            "(..., classes): return only the logits (a Hugging Face model's output.logits)"
        )
    for batches, name in ((train_batches, "the training set"), (test_batches, "the test set")):
        batches.expect(expected | {"logits": list(logits.shape[1:])}, name)


def check_data(inputs, labels, samples, expected, name="the data"):
    """One line for data that does not fit the model (``check_data_fits``'s ``expected``).
    ``samples``: the data set's index of each row, or None; ``labels``: None, for ids alone;
    ``name``: the data set's."""
    checks = []  # (what, its tensor, how many the model has, what the model has, the fix)
    if expected.get("embedding") and not inputs.is_floating_point():
        module, rows = expected["embedding"]
        has, fix = f"vocabulary of {{}} (the rows of {module})", "a vocabulary of at least {}"
        checks.append(("token id", inputs, rows, has, fix))
    if labels is not None and not labels.is_floating_point():  # floats: probabilities
        targets, logits = list(labels.shape[1:]), expected["logits"]
        same_inputs = list(inputs.shape[1:]) == expected["inputs"]  # else only the dims agree
        if len(targets) != len(logits) - 1 or (same_inputs and targets != logits[:-1]):
            raise UsageError(
                f"the data's targets are {targets} a sample, and the model's logits {logits}: "
                f"cross_entropy takes a class index per row of logits, {logits[:-1]} a sample; "
                "make the model's output or the labels fit"
            )
        has, fix = "{} classes (its logits' last dimension)", "at least {} outputs"
        checks.append(("label", labels, logits[-1], has, fix))
    bounds = [b.long() for _, t, *_ in checks for b in (t.min(), t.max())]
    bounds = torch.stack(bounds).tolist() if bounds else []  # one sync
    for (what, tensor, size, has, fix), low, high in zip(checks, bounds[::2], bounds[1::2]):
        if low < 0 or high >= size:
            bad = low if low < 0 else high
            row = (tensor == bad).reshape(len(tensor), -1).any(dim=1).nonzero()[0, 0].item()
            sample = "a sample" if samples is None else f"sample {samples[row]}"
            raise UsageError(
                f"{sample} of {name} has {what} {bad}, outside the model's {has.format(size)}: "
                f"fix the data, or give the model {fix.format(max(bad + 1, size))}"
            )


@torch.compiler.set_stance("force_eager")  # --compile's graphs: training's only (torch 2.6+)
@torch.no_grad()
def evaluate(forward, batches, rank, world_size, pipeline=False):
    """This replica's [loss sum, correct, count] over targets, to all-reduce; all run as many
    batches (FSDP gathers in each), the padding uncounted; a pipeline's forward takes labels."""
    size, count = batches.batch_size, len(batches.dataset)
    shard = torch.arange(count).tensor_split(world_size)[rank].tolist()
    longest = -(-count // world_size)
    padded = shard + [0] * ((-(-longest // size) * size if pipeline else longest) - len(shard))
    totals = torch.zeros(3, dtype=torch.float64, device=batches.device)
    for i, (inputs, labels) in enumerate(batches(padded)):
        logits = forward(inputs, labels) if pipeline else forward(inputs)
        real = len(shard[i * size : (i + 1) * size])  # 0 in a batch of padding alone
        if logits is not None and real:
            logits, labels = logits[:real].float().flatten(0, -2), labels[:real].flatten()
            loss = F.cross_entropy(logits, labels, reduction="sum")
            correct = (logits.argmax(dim=1) == labels).sum()
            totals += torch.stack([loss.double(), correct.double(), totals.new_tensor(len(labels))])
    return totals
