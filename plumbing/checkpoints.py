"""Outputs and files: --save, whole-file writes, the outputs checked before training, and the
Checkpointer every script calls (its checkpoints: plumbing/checkpoint_dir.py)."""

import errno
import importlib
import json
import math
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from plumbing.failures import UsageError, on_rank_0


def write_atomically(path, write, size=0):
    """``write(file)`` to a file renamed over ``path``: never half a file."""
    folder, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:  # torch.save may hide an OSError
        if os.path.exists(temporary):  # before the free space is measured
            size = max(size, os.path.getsize(temporary))
            os.remove(temporary)
        if not isinstance(error, OSError) and not isinstance(error.__context__, OSError):
            raise
        raise UsageError(f"{path} was not written ({cannot_write(path, error, size)})") from None


def cannot_write(path, error, needed=0):
    """Why a write failed; for a full disk, the room left."""
    error = error.__context__ if isinstance(error.__context__, OSError) else error
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    if getattr(error, "errno", None) == errno.ENOSPC or free < needed:
        return (
            f"the disk is full: {free / 1e6:.1f} MB are free there, "
            f"this needs at least {needed / 1e6:.1f} MB"
        )
    return getattr(error, "strerror", None) or " ".join(str(error).split())


def save_on_rank_0(state_dict, path):
    """Collective: rank 0 saves finite CPU tensors (for weights_only); all raise its errors."""

    def write():
        state = {name: tensor.detach().cpu() for name, tensor in state_dict.items()}
        for name, tensor in state.items():
            if tensor.is_floating_point() and not tensor.isfinite().all():
                raise UsageError(
                    f"{path} was not written: {name} is not finite (training diverged); "
                    "lower --lr or raise --warmup-steps"
                )
        size = sum(t.nbytes for t in state.values())
        write_atomically(path, lambda file: torch.save(state, file), size)

    on_rank_0(write, "writing --save")


def save_json(value, path):
    write_atomically(path, lambda file: file.write((json.dumps(value, indent=2) + "\n").encode()))


class Checkpointer:
    """What every run does about checkpoints: checks its outputs, seeds each rank, refuses a loss
    that is not finite. With --checkpoint-dir (or --resume-from) it saves and resumes too, by
    plumbing/checkpoint_dir.py, imported only then."""

    def __init__(self, args, plan, device):
        self.args = args
        wanted = args.checkpoint_dir or args.resume_from  # an opt-in module (training.OPT_IN)
        module = wanted and importlib.import_module("plumbing.checkpoint_dir")
        self.checkpoints = module.Checkpoints(args, plan, device) if module else None

    def is_due(self, step, now):
        """Each --checkpoint-every, a stop, and the end: then a requeue has nothing to do."""
        return bool(self.checkpoints) and self.checkpoints.is_due(step, now)

    def save(self, step, epoch, steps_into_epoch, model, optimizer, losses):
        """Collective: step-<N> (checkpoint_dir.Checkpoints.save)."""
        self.checkpoints.save(step, epoch, steps_into_epoch, model, optimizer, losses)

    def resume(self, model, optimizer, log, aliases=None):
        """Collective with --checkpoint-dir: where to go on, from the newest intact checkpoint, if
        any (checkpoint_dir.Checkpoints.resume). Each rank's own seed first: dropout draws its own
        masks on each rank, as nanoGPT's seed + rank; a checkpoint's random states replace it."""
        torch.manual_seed(self.args.seed + dist.get_rank())  # the model was built from seed
        if not self.checkpoints:
            return {"step": 0, "epoch": 0, "samples_into_epoch": 0}
        return self.checkpoints.resume(model, optimizer, log, aliases)

    def refuse_divergence(self, step, loss):
        """Raise ``diverged`` if ``loss`` (every rank's) is not finite."""
        if not math.isfinite(loss):
            raise diverged(step, f"the training loss is {loss}", self.checkpoints)

    def check_outputs(self):
        """Collective: rank 0 tries each output path, to fail before training."""
        on_rank_0(self._check_outputs, "checking the outputs")

    def _check_outputs(self):
        args = self.args
        if args.save and args.metrics:
            if os.path.abspath(args.save) == os.path.abspath(args.metrics):
                raise UsageError(
                    f"--save and --metrics are both {args.save}: the metrics would replace "
                    "the weights; give two paths"
                )
        outputs = [("--checkpoint-dir", args.checkpoint_dir, True), ("--save", args.save, False)]
        outputs += [("--metrics", args.metrics, False), ("--log-dir", args.log_dir, True)]
        for flag, path, folder in outputs:
            if not path:
                continue
            try:
                if folder and os.path.isfile(path):
                    raise OSError("it is a file, not a directory")
                if not folder and (os.path.isdir(path) or path.endswith("/")):
                    raise OSError("it names a directory, not a file")
                directory = path if folder else os.path.dirname(os.path.abspath(path))
                os.makedirs(directory, exist_ok=True)
                tempfile.TemporaryFile(dir=directory).close()  # a real write there
            except OSError as error:
                why = error.strerror or error
                raise UsageError(f"{flag} {path}: cannot write there ({why})") from None


def diverged(step, what, checkpoints=None):
    """A diverged run's UsageError, naming its newest checkpoint."""
    saved = "nothing was saved: no --checkpoint-dir"
    if checkpoints and checkpoints.directory:
        saved = checkpoints.what_is_saved()
    return UsageError(
        f"{what} at step {step}: training diverged; lower --lr or raise --warmup-steps, "
        f"or it diverges again ({saved})"
    )
