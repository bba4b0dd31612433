"""What every training script needs but none of them teaches: flags, optimizer, logging, files.

The distributed lines each script teaches (process group, sampler, wrapping, collectives, who
saves) stay inline in the script; only strategy-neutral plumbing lives here.
"""

import argparse
import gc
import json
import math
import os
import resource
import signal
import sys
import tempfile
import threading
import time
from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from models import data


class UsageError(Exception):
    """Bad flags or a layout that cannot work: printed as one line by rank 0, exit code 2."""


class Stopped(Exception):
    """Every rank stopped at the same step on a signal, after writing a checkpoint when there is a directory."""

    def __init__(self, signal_number, step, total_steps, checkpoint_dir):
        name = signal.Signals(signal_number).name
        saved = (f"checkpoint step-{step} is in {checkpoint_dir}; the same command resumes there" if checkpoint_dir
                 else "nothing was saved (no --checkpoint-dir)")
        super().__init__(f"stopped by {name} at step {step} of {total_steps}: {saved}")
        self.exit_code = 128 + signal_number  # the shell's code for this signal: schedulers read it as "requeue"


class NodeError(UsageError):
    """A problem of one node (its GPUs): printed as one line by that node's local rank 0, exit code 2.

    Every rank of the node finds it before the process group exists, so rank 0 (perhaps on another,
    healthy node) cannot be told; each failing node speaks for itself.
    """


def launched_rank():
    """This process's global rank as torchrun tells it (0 when run without torchrun)."""
    return int(os.environ.get("RANK", "0"))


def fail_cleanly(main):
    """Run ``main()``; turn a UsageError or DataError into one line on rank 0 and exit code 2, and a stop
    on a signal into one line on rank 0 and exit code 128 + the signal's number.

    Every rank reaches the same verdict from the same flags (or from rank 0's broadcast), so the
    others just exit quietly instead of printing the same message N times. When torchrun restarts
    the workers (MAX_RESTARTS), the restarts fail the same way; only the first attempt says so.
    """
    try:
        main()
    except Stopped as stopped:  # every rank agreed to stop: rank 0 says where, all exit with the same code
        if launched_rank() == 0:
            print(stopped, file=sys.stderr, flush=True)
        sys.exit(stopped.exit_code)
    except (UsageError, data.DataError) as error:
        local = isinstance(error, NodeError)
        say_once(f"error: {error}", rank=int(os.environ.get("LOCAL_RANK", "0")) if local else launched_rank())
        sys.exit(2)
    finally:
        # DDP and FSDP modules sit in reference cycles that keep the process group (and gloo's
        # worker threads) alive until a garbage collection. Left to the interpreter's shutdown,
        # that collection can run when threads may no longer take the GIL, and gloo aborts the
        # process ("terminate called without an active exception"). Collect them now instead.
        gc.collect()


def die_with_launcher():
    """Die when the launcher that started this process (torchrun) dies.

    torchrun stops its workers when it exits or gets SIGTERM or SIGINT, but SIGKILL (the OOM killer, a
    scheduler's hard kill) gives it no chance: its workers would be adopted by another process and
    train on, writing checkpoints that a restarted job in the same --checkpoint-dir then races with.
    On Linux the kernel sends this process SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG);
    elsewhere a daemon thread checks the parent every 0.1 s.
    """
    launcher = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher:  # it died before the line above took effect
            os._exit(1)
        return

    def watch():
        while os.getppid() == launcher:
            time.sleep(0.1)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-launcher", daemon=True).start()


class StopSignals:
    """From now on SIGTERM, SIGUSR1 and SIGINT ask for a stop at a step boundary instead of killing the process.

    SIGTERM is how Kubernetes, SLURM's preemption and torchrun (forwarding its own) stop a job; SIGUSR1 is
    what SLURM's ``--signal`` sends ahead of the time limit; SIGINT is Ctrl-C. The handler only records the
    signal in ``received``: the training loop reads it where all ranks meet (each logging step), because a
    signal reaches the ranks at different moments and a rank that stopped alone would leave the others
    waiting in their next collective. Before training starts, the signals keep their default action: there
    is nothing to save yet.
    """

    def __init__(self):
        self.received = 0  # the signal's number; 0 until one arrives
        for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(number, self._record)

    def _record(self, number, frame):
        self.received = self.received or number  # the first one counts


def say_once(line, rank):
    """Print ``line`` to stderr from the process whose ``rank`` is 0, on torchrun's first attempt only."""
    if rank == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        print(line, file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + error on every rank; we print one line once
        say_once(f"error: {message} (see --help)", rank=launched_rank())
        sys.exit(2)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Append "(default: X)" to a flag's help only when X says something: not for None, nor twice."""

    def _get_help_string(self, action):
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def positive_int(text):
    """argparse type: an integer of 1 or more (the scripts' own flags use it too)."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {value}")
    return value


def _non_negative_float(text):
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, got {text}")
    return value


def _momentum(text):
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text}")
    return value


def _positive_float(text):
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parser(description):
    """The flags all three scripts share; each script adds its own strategy's flags."""
    p = _Parser(description=description, formatter_class=_HelpFormatter)
    add = p.add_argument
    add("--dataset", choices=data.DATASETS, default="auto",
        help="auto: MNIST if on disk or downloadable, else synthetic")
    add("--data-dir", default="./data", help="where torchvision datasets are read from and downloaded to")
    add("--no-download", action="store_true", help="never use the network; use only files already in --data-dir")
    add("--epochs", type=positive_int, default=2)
    add("--max-steps", type=_non_negative_int, default=0, help="stop after this many optimizer steps (0: no limit)")
    add("--batch-size", type=positive_int, default=64, help="samples per micro-step on each data-parallel replica")
    add("--grad-accum", type=positive_int, default=1, help="micro-steps accumulated per optimizer step")
    add("--optimizer", choices=("adamw", "sgd"), default="adamw")
    add("--lr", type=_positive_float, default=None, help="peak learning rate (default: 1e-3 for adamw, 0.01 for sgd)")
    add("--momentum", type=_momentum, default=0.9, help="SGD momentum")
    add("--weight-decay", type=_non_negative_float, default=None, help="(default: 0.01 for adamw, 5e-4 for sgd)")
    add("--scale-lr", action="store_true", help="linear scaling rule: lr *= global_batch_size / base_batch_size")
    add("--base-batch-size", type=positive_int, default=64, help="the global batch size --lr was tuned for")
    add("--warmup-steps", type=_non_negative_int, default=0, help="ramp the lr linearly over this many optimizer steps")
    add("--device", choices=("auto", "cuda", "cpu"), default="auto",
        help="auto: the GPU cuda:LOCAL_RANK when CUDA is available (NCCL), else the CPU (gloo)")
    add("--precision", choices=("fp32", "bf16", "fp64"), default="fp32",
        help="bf16: autocast the forward pass to bfloat16; fp64: the whole model in float64 (slow; the tests use "
        "it to compare strategies far above float32's rounding)")
    add("--compile", action="store_true",
        help="torch.compile each of BabyCNN's blocks in place, before wrapping (compiles on the first steps)")
    add("--width", type=positive_int, default=1, help="BabyCNN channel multiplier (parameters grow with its square)")
    add("--seed", type=int, default=0, help="same initial weights and data order on every rank")
    add("--log-every", type=positive_int, default=20, help="optimizer steps between all-reduced loss readings")
    add("--no-eval", action="store_true", help="skip the test-set evaluation after each epoch (for measurements)")
    add("--checkpoint-dir", metavar="DIR", help="save checkpoints here, and resume from the newest one found there")
    add("--checkpoint-every", type=positive_int, default=100, help="optimizer steps between checkpoints")
    add("--keep-checkpoints", type=positive_int, default=2, help="how many of the newest checkpoints to keep")
    add("--save", metavar="PATH", help="write the final weights as a plain state dict (rank 0)")
    add("--metrics", metavar="PATH", help="write a JSON summary of the run (rank 0)")
    return p


def learning_rate(args, global_batch_size):
    """The peak learning rate, after the linear scaling rule when --scale-lr asks for it."""
    lr = args.lr if args.lr is not None else {"adamw": 1e-3, "sgd": 0.01}[args.optimizer]
    return lr * global_batch_size / args.base_batch_size if args.scale_lr else lr


def make_optimizer(args, parameters, lr):
    """The optimizer, and a scheduler for the linear warmup (then a constant lr)."""
    # Without fused/foreach, torch.optim on CPU loops over the parameters in Python (foreach is its
    # default only on CUDA). Fused AdamW updates every tensor in one kernel: 0.37 ms against 1.8 ms per
    # step for BabyCNN on one CPU thread, about 3% of a training step. SGD gets foreach: fused SGD has
    # no DTensor rule, so FSDP could not use it.
    if args.optimizer == "sgd":
        weight_decay = 5e-4 if args.weight_decay is None else args.weight_decay
        optimizer = torch.optim.SGD(parameters, lr=lr, momentum=args.momentum, weight_decay=weight_decay, foreach=True)
    else:
        weight_decay = 0.01 if args.weight_decay is None else args.weight_decay
        optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay, fused=True)
    # LinearLR multiplies the lr by a factor going from 1/(warmup+1) to 1 over the warmup steps.
    start = 1 / (args.warmup_steps + 1)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=start, total_iters=args.warmup_steps)
    return optimizer, scheduler


def use_cuda(device_flag, local_rank):
    """True when this process should train on cuda:LOCAL_RANK; a NodeError when it cannot.

    Runs before any CUDA call. torch.cuda.device_count() honours CUDA_VISIBLE_DEVICES (nvidia-smi
    does not), and every rank of a node checks the node's whole LOCAL_WORLD_SIZE, so all of them
    stop together instead of one rank dying on "invalid device ordinal".
    """
    if device_flag == "cpu" or (device_flag == "auto" and not torch.cuda.is_available()):
        return False
    gpus = torch.cuda.device_count()
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    if processes > gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        way_out = (f"start at most {gpus} per node (NPROC_PER_NODE={gpus})" if gpus
                   else "use a machine with GPUs and a CUDA build of torch")
        need = (f"{processes} processes on this node need {processes} GPUs" if processes > 1
                else "--device cuda needs a GPU")
        raise NodeError(f"{need}, but torch sees {gpus}{shown}: "
                        f"{way_out}, or train on the CPU with --device cpu")
    return True


def dtype(args):
    """The dtype of the weights: float32, or float64 with --precision fp64 (bf16 autocasts fp32 weights)."""
    return torch.float64 if args.precision == "fp64" else torch.float32


def autocast(args, device):
    """The autocast context for the forward pass (bf16 on CPU and GPU alike), or a no-op for fp32 and fp64."""
    if args.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def _local_bytes(tensor):
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()  # an FSDP shard: count what this rank holds
    return tensor.numel() * tensor.element_size()


def state_bytes(model, optimizer):
    """Bytes of parameters + gradients + optimizer state held by this rank."""
    total = 0
    for parameter in model.parameters():
        total += _local_bytes(parameter)
        if parameter.grad is not None:
            total += _local_bytes(parameter.grad)
    for state in optimizer.state.values():
        total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def peak_memory_bytes(device):
    """CUDA's max allocated bytes on GPU; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _write_atomically(path, write):
    """Write to a temporary file beside ``path``, then rename: readers never see half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(handle, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes it 0600: give it the mode open() would
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def save_state_dict(state_dict, path):
    """Save a plain ``{name: tensor}`` state dict (on CPU) so ``torch.load(weights_only=True)`` reads it."""
    state_dict = {name: tensor.detach().cpu() for name, tensor in state_dict.items()}
    _write_atomically(path, lambda file: torch.save(state_dict, file))


def check_output_paths(args):
    """Fail at start-up, not after training, when --save, --metrics or --checkpoint-dir cannot be written.

    Rank 0 tries a real write beside each file (in the checkpoint directory) and tells the others the verdict.
    """
    import torch.distributed as dist

    verdict = [None]
    if dist.get_rank() == 0:
        if args.save and args.metrics and os.path.abspath(args.save) == os.path.abspath(args.metrics):
            verdict[0] = (f"--save and --metrics are both {args.save}: the metrics would replace the weights; "
                          "give two paths")
        if args.checkpoint_dir and verdict[0] is None:
            try:
                if os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
                    raise NotADirectoryError("it is a file, not a directory")
                os.makedirs(args.checkpoint_dir, exist_ok=True)
                probe = os.path.join(args.checkpoint_dir, ".write-test")
                _write_atomically(probe, lambda file: None)
                os.unlink(probe)
            except OSError as error:
                verdict[0] = f"--checkpoint-dir {args.checkpoint_dir}: cannot write there ({error.strerror or error})"
        for flag, path in (("--save", args.save), ("--metrics", args.metrics)):
            if path and verdict[0] is None:
                probe = os.path.join(os.path.dirname(os.path.abspath(path)), ".write-test")
                try:
                    if os.path.isdir(path):
                        raise IsADirectoryError("it is a directory")
                    _write_atomically(probe, lambda file: None)
                    os.unlink(probe)
                except OSError as error:
                    verdict[0] = f"{flag} {path}: cannot write there ({error.strerror or error})"
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise UsageError(verdict[0])


class Progress:
    """Rank 0's progress bar, the training clock (evaluation excluded) and the loss curve.

    On a GPU the clock is read after ``torch.cuda.synchronize()``: kernels run asynchronously, so
    an unsynchronised clock times their launch, not their work. It is read only at epoch edges and
    logging windows (where the loss comes to the host anyway), never per step.

    Two rates: the whole run's, and the steady state's, from the first logging point past a tenth
    of the run (at least one window) to the end: the first steps pay for lazy initialisation,
    cuDNN's algorithm search and the allocator's growth.
    """

    def __init__(self, total_steps, global_batch_size, rank, log_every, device, start_step=0):
        self.total_steps, self.global_batch_size, self.log_every = total_steps, global_batch_size, log_every
        # In a log file (not a terminal) a redraw every 10 s is plenty.
        refresh = 0.1 if sys.stderr.isatty() else 10
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", disable=rank != 0, dynamic_ncols=True,
                        mininterval=refresh)
        self.start_step = self.step = start_step  # a resumed run counts on from its checkpoint
        self.train_seconds, self.loss_curve = 0.0, []
        self.final_train_loss = float("nan")
        self._started = None
        self._synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._warmup_steps = max(log_every, (total_steps - start_step) // 10)
        self._steady_from = None  # (step, training seconds) where the steady-state clock starts

    def _clock(self):
        self._synchronize()
        return time.perf_counter()

    def _training_seconds(self):
        return self.train_seconds + (self._clock() - self._started if self._started is not None else 0.0)

    def start_epoch(self):
        self._started = self._clock()

    def end_epoch(self):
        self.train_seconds += self._clock() - self._started
        self._started = None
        if self.step == self.total_steps:
            self.bar.close()  # before the last evaluation, so the bar's rate is the training rate

    def samples_per_second(self):
        return (self.step - self.start_step) * self.global_batch_size / max(self._training_seconds(), 1e-9)

    def steady_samples_per_second(self):
        """Samples per second after the warm-up steps; None when the run was too short to have any."""
        if self._steady_from is None or self.step == self._steady_from[0]:
            return None
        step, seconds = self._steady_from
        return (self.step - step) * self.global_batch_size / max(self._training_seconds() - seconds, 1e-9)

    def update(self, end_of_epoch):
        """Count one optimizer step; True when the loss window should be reduced and logged."""
        self.step += 1
        self.bar.update()
        return self.step % self.log_every == 0 or self.step == self.total_steps or end_of_epoch

    def record_loss(self, loss, label):
        if not math.isfinite(loss):  # every rank holds the same all-reduced value, so all stop here
            self.close()  # end the bar's line, so the error has a line of its own
            raise UsageError(f"the training loss is {loss} at step {self.step}: training diverged; lower --lr or add "
                             "--warmup-steps (no weights were saved)")
        self.final_train_loss = loss
        self.loss_curve.append([self.step, loss])
        if self._steady_from is None and self.step - self.start_step >= self._warmup_steps:
            self._steady_from = (self.step, self._training_seconds())
        self.bar.set_postfix({label: f"{loss:.4f}", "samples/s": f"{self.samples_per_second():.0f}"})

    def close(self):
        self.bar.close()

    def summary(self):
        return {
            "steps": self.step,
            "samples_per_second": self.samples_per_second(),
            "steady_samples_per_second": self.steady_samples_per_second(),
            "steady_from_step": self._steady_from[0] if self._steady_from else None,
            "train_seconds": self.train_seconds,
            "final_train_loss": self.final_train_loss,
            "loss_curve": self.loss_curve,
        }


def write_metrics(path, summary, per_rank_state):
    """Gather every rank's ``per_rank_state`` dict; rank 0 writes ``summary`` plus that list as JSON."""
    import torch.distributed as dist

    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, per_rank_state)
    if dist.get_rank() == 0:
        text = json.dumps({**summary, "ranks": per_rank}, indent=2) + "\n"
        _write_atomically(path, lambda file: file.write(text.encode()))
