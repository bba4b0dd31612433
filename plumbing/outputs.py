"""What a run writes besides its checkpoints (plumbing/checkpoint_dir.py): --save, whole files
written at once, the outputs tried before training, and the line a diverged run ends with."""

import errno
import json
import math
import os
import shutil
import tempfile

import torch

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


def check(args):
    """Collective: rank 0 tries each output path, to fail before training."""
    on_rank_0(lambda: _try_outputs(args), "checking the outputs")


def _try_outputs(args):
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


def refuse_divergence(step, loss, checkpoints=None):
    """Raise ``diverged`` if ``loss`` (every rank's) is not finite."""
    if not math.isfinite(loss):
        raise diverged(step, f"the training loss is {loss}", checkpoints)


def diverged(step, what, checkpoints=None):
    """A diverged run's UsageError, naming its newest checkpoint (``checkpoints``: the run's
    checkpoint_dir.Checkpoints, or None)."""
    saved = "nothing was saved: no --checkpoint-dir"
    if checkpoints and checkpoints.directory:
        saved = checkpoints.what_is_saved()
    return UsageError(
        f"{what} at step {step}: training diverged; lower --lr or raise --warmup-steps, "
        f"or it diverges again ({saved})"
    )
