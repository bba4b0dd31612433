"""--checkpoint-dir DIR: checkpoints every --checkpoint-every steps, at a stop and at the end, and
the newest intact one resumed (opt-in: imported only when the flag, or --resume-from, is given, so
a copy without this file refuses them in one line)."""

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_leaves

from plumbing import training
from plumbing.checkpoints import cannot_write, diverged, save_json
from plumbing.failures import USER_ERRNOS, Retryable, UsageError, on_rank_0, transient

FORMAT = 4  # of checkpoint.json: 4 holds the peak lr


def _renamed(optimizer_state, aliases):
    """The optimizer's states by name, a tied weight's under its first name in the whole model
    (a pipeline's last stage holds the head's copy of the embedding): one state in the file,
    which any strategy resumes."""
    return {aliases.get(name, name): state for name, state in optimizer_state.items()}


def _local(state):  # its tensors; of a DTensor, this rank's part
    return [getattr(t, "_local_tensor", t) for t in tree_leaves(state) if torch.is_tensor(t)]


def _fresh_state_dicts(model, optimizer):
    """get_state_dict of a fresh optimizer, its states made: torch makes them (a step of lr 0)
    only where no gradient is set, and gradients kept for CUDA graphs (train_ddp.py's --compile
    --grad-accum) left none, and none loaded. They are set aside meanwhile."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        return get_state_dict(model, optimizer)
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad


def _first_cause(error):  # DCP's failures: {rank: (exception, traceback)}
    return next(iter(getattr(error, "failures", {}).values()), [error])[0]


class Checkpoints:
    """step-<N> in --checkpoint-dir, seen by all ranks: DCP's files, by name (any strategy
    resumes any other's), and checkpoint.json with their SHA-256s."""

    def __init__(self, args, plan, device):
        self.args, self.directory, self.device = args, args.checkpoint_dir, device
        self.peak_lr, self.total_steps = plan.peak_lr, plan.total_steps
        self.layout = {"dataset": plan.dataset_name, "world_size": dist.get_world_size()}
        self.layout |= {"global_batch_size": plan.global_batch_size, "device": device.type}
        self.layout["optimizer"] = getattr(args, "optimizer", None)  # its state must be the same
        self.branch = None  # rank 0's: the --resume-from it descends from
        self.aliases = {}  # resume's

    def is_due(self, step, now):
        """Each --checkpoint-every, a stop, and the end: then a requeue has nothing to do."""
        every, last = self.args.checkpoint_every, self.total_steps
        return bool(self.directory) and (now or step % every == 0 or step == last)

    def save(self, step, epoch, steps_into_epoch, model, optimizer, losses):
        """Collective: save step-<N> if all weights, states and ``losses`` are finite:
        each rank writes .tmp-step-<N>; rank 0 adds checkpoint.json, renames it."""
        final = os.path.join(self.directory, f"step-{step}")
        temporary = os.path.join(self.directory, f".tmp-step-{step}")
        model_state, optimizer_state = get_state_dict(model, optimizer)
        rng = {f"rank{dist.get_rank()}": self._random_states()}
        optimizer_tensors = _renamed(optimizer_state["state"], self.aliases)
        state = {"model": model_state, "optimizer": optimizer_tensors, "rng": rng}
        checked = [t for t in _local(state) if t.is_floating_point()] + list(losses)
        finite = torch.stack([t.isfinite().all().to(self.device) for t in checked]).all()
        finite = finite.to(torch.int32)  # one sync for them all
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite:
            raise diverged(step, "a weight, an optimizer state or the loss is not finite", self)
        try:
            dcp.save(state, checkpoint_id=temporary)  # one rank fails: all raise
        except (OSError, RuntimeError, CheckpointException) as error:
            raise self._not_written(step, temporary, error, state) from None

        def finish():  # rank 0, once every rank's files are written
            try:
                names = sorted(os.listdir(temporary))
                files = {name: _fingerprint(os.path.join(temporary, name)) for name in names}
                done = steps_into_epoch * self.layout["global_batch_size"]
                info = {"format": FORMAT, "layout": self.layout, "step": step, "epoch": epoch}
                info |= {"samples_into_epoch": done, "peak_lr": self.peak_lr}
                info |= {"branch": self.branch, "files": files}
                save_json(info, os.path.join(temporary, "checkpoint.json"))
                shutil.rmtree(final, ignore_errors=True)  # a rerun saved it before
                os.replace(temporary, final)
            except (OSError, UsageError) as error:
                raise self._not_written(step, temporary, error, state) from None
            self._remove_strays()
            for old in self.complete()[: -self.args.keep_checkpoints]:
                shutil.rmtree(os.path.join(self.directory, old), ignore_errors=True)

        on_rank_0(finish, f"finishing checkpoint step-{step}")  # all wait for it

    def _not_written(self, step, temporary, error, state):
        """A UsageError (the disk, its permissions), or else a Retryable."""
        cause = _first_cause(error)
        why = cannot_write(temporary, cause, sum(t.nbytes for t in _local(state)))
        shutil.rmtree(temporary, ignore_errors=True)
        os_error = cause if isinstance(cause, OSError) else cause.__context__  # 2.9 hides it
        user = isinstance(os_error, OSError) and os_error.errno in USER_ERRNOS
        line = f"checkpoint step-{step} was not written to {self.directory} ({why})"
        if isinstance(error, UsageError) or why.startswith("the disk is full") or user:
            return UsageError(
                f"{line}: the ones saved before it are intact; "
                "fix that, and the same command resumes from them"
            )
        return Retryable(f"{line}; the ones saved before it are intact")

    def _check_shared(self, wait=60):
        """Collective: every rank sees a file rank 0 writes in the folder (within ``wait`` s: NFS
        may cache a folder's listing), or all raise one line naming those that do not: in a
        folder of each node's own, each saves its ranks' parts alone, and a resume fails."""
        if not self.directory or dist.get_world_size() == 1:
            return
        make = lambda: tempfile.mkstemp(prefix=".shared-", dir=self.directory)[1]  # noqa: E731
        name = os.path.basename(on_rank_0(make, "writing into --checkpoint-dir"))
        probe = os.path.join(self.directory, name)  # in this rank's own --checkpoint-dir
        deadline = time.monotonic() + wait
        while not os.path.exists(probe) and time.monotonic() < deadline:
            time.sleep(0.5)
        here = None if os.path.exists(probe) else f"{dist.get_rank()} ({socket.gethostname()})"
        blind = [None] * dist.get_world_size()
        dist.all_gather_object(blind, here)  # collective: all have looked
        if dist.get_rank() == 0:
            os.remove(probe)
        if blind := [rank for rank in blind if rank]:
            raise UsageError(
                f"--checkpoint-dir {self.directory} is not shared: rank(s) {', '.join(blind)} "
                "do not see rank 0's files there, yet every rank writes its part of each "
                "checkpoint there and reads them all to resume; give a folder every node mounts"
            )

    def what_is_saved(self):
        """For a diverged run's line: the newest checkpoint, which the same command resumes."""
        if not (saved := self.complete()):
            return f"no checkpoint is in {self.directory}: a rerun starts from step 0"
        newest = os.path.join(self.directory, saved[-1])
        return (
            f"nothing after {saved[-1]} was saved; the same command resumes from {newest}, "
            "which is finite, as every checkpoint is"
        )

    def _random_states(self):
        states = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self.device)
        return states

    def complete(self):  # oldest first
        return complete(self.directory)

    def _remove_strays(self):  # crashed saves' .tmp-step-<N>
        for stray in (n for n in _names(self.directory) if n.startswith(".tmp-step-")):
            shutil.rmtree(os.path.join(self.directory, stray), ignore_errors=True)

    def resume(self, model, optimizer, log, aliases=None):
        """Collective: load the newest intact checkpoint, if any, with each rank's random
        states; where to go on. ``aliases`` ({name: name in the whole model}) name optimizer
        states here and in every save (_renamed)."""
        self.aliases = aliases or {}
        self._check_shared()  # collective
        found = on_rank_0(lambda: self._newest_intact(log), "finding a checkpoint")
        if found is None:
            return {"step": 0, "epoch": 0, "samples_into_epoch": 0}
        path, info = found
        # Not before: get_state_dict steps a fresh optimizer.
        model_state, optimizer_state = _fresh_state_dicts(model, optimizer)
        optimizer_tensors = _renamed(optimizer_state["state"], self.aliases)
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        if not optimizer_tensors and any(name.startswith("optimizer.") for name in saved):
            raise UsageError(
                f"checkpoint {path} holds optimizer states, but this run's optimizer has none to "
                "load them into (SGD without the checkpoint's --momentum?): resuming would start "
                "them from zero; resume with the checkpoint's optimizer flags"
            )
        tensors = {"model": model_state, "optimizer": optimizer_tensors}  # in place
        same_ranks = all(info["layout"].get(k) == self.layout[k] for k in ("world_size", "device"))
        if same_ranks:  # random states: each rank's own
            tensors["rng"] = {f"rank{dist.get_rank()}": self._random_states()}
        try:
            dcp.load(tensors, checkpoint_id=path)
        except (Exception, CheckpointException) as error:  # the same on every rank
            cause = _first_cause(error)
            # Intact files: a missing name or shape is another model's; else a retry may pass.
            if isinstance(cause, (ValueError, KeyError)) or str(cause).startswith("Missing key"):
                why = " ".join(str(cause).split())[:200]
                raise UsageError(
                    f"checkpoint {path} does not load into this run ({why}): another model's? "
                    "use another --checkpoint-dir"
                ) from None
            why = transient(cause) or type(cause).__name__
            line = f"checkpoint {path} was not loaded ({why}): it is intact (its SHA-256s match)"
            raise Retryable(line) from None
        set_state_dict(
            model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state
        )
        for kind, state in tensors.get("rng", {}).get(f"rank{dist.get_rank()}", {}).items():
            if kind == "cpu":
                torch.set_rng_state(state)
            else:
                torch.cuda.set_rng_state(state, self.device)
        log(f"resumed from {path} (step {info['step']}, epoch {info['epoch'] + 1})")
        if self.args.init_from:  # a requeued job goes on, not over
            log(f"--init-from {self.args.init_from} is not used: the checkpoint is newer")
        if info["peak_lr"] != self.peak_lr:  # another --lr or --scale-lr batch
            log(
                f"the peak lr is now {self.peak_lr:g}, not the checkpoint's {info['peak_lr']:g}: "
                "the schedule goes on"
            )
        saved, batch = info["samples_into_epoch"], self.layout["global_batch_size"]
        back = saved % batch  # steps start at whole global batches
        if back:
            log(
                f"the global batch changed from {info['layout']['global_batch_size']} to {batch}: "
                f"epoch {info['epoch'] + 1} continues at sample {saved - back}, not {saved}, "
                f"so {back} samples are seen twice"
            )
        return {**info, "samples_into_epoch": saved - back}

    def _newest_intact(self, log):
        """On rank 0: (path, checkpoint.json) or None; --resume-from's, if given."""
        found = self._newest_in_directory(log)
        self.branch = found[1].get("branch") if found else None  # its checkpoints keep it
        resume_from = training.opt_in(self.args, "resume_from")
        return resume_from.choose(self, found, log) if resume_from else found

    def _newest_in_directory(self, log):
        """On rank 0: (path, checkpoint.json) or None; newer damaged ones go aside."""
        damaged = []  # (name, what is wrong), newest first
        self._remove_strays()
        for name in reversed(self.complete()):
            path = os.path.join(self.directory, name)
            info, problem = verify(path, self.layout)
            if problem is None:
                for bad_name, why in damaged:
                    bad = os.path.join(self.directory, bad_name)
                    aside = unused_path(os.path.join(self.directory, "damaged-" + bad_name))
                    os.replace(bad, aside)
                    log(
                        f"checkpoint {bad} is damaged ({why}): moved it to {aside}; "
                        "resuming from an older one"
                    )
                return path, info
            damaged.append((name, problem))
        if damaged:  # none moved: a restart must not go back to step 0 unsaid
            faults = "; ".join(f"{bad}: {why}" for bad, why in damaged)
            raise UsageError(
                f"no intact checkpoint in {self.directory}: {faults}; restore one, "
                "or use another --checkpoint-dir"
            )


def _names(folder):
    return os.listdir(folder) if folder and os.path.isdir(folder) else []


def complete(folder):
    """The complete checkpoints in ``folder``, oldest first: only a finished save is named
    step-<N>, renamed from .tmp-step-<N> once written."""
    names = [n for n in _names(folder) if n.startswith("step-") and n[5:].isdigit()]
    return sorted(names, key=lambda name: int(name[5:]))


def verify(path, layout=None):
    """(checkpoint.json, None) if every file matches, or (None, what is damaged)."""
    manifest = os.path.join(path, "checkpoint.json")
    try:
        with open(manifest) as file:
            info = json.load(file)
        files = {name: [int(size), str(digest)] for name, (size, digest) in info["files"].items()}
        if ".metadata" not in files or info["format"] != FORMAT:
            found = f"format {info['format']} (this code reads {FORMAT}), files {sorted(files)}"
            raise ValueError(found)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return None, f"checkpoint.json is unreadable: {error}"
    if layout and info["layout"]["dataset"] != layout["dataset"]:  # another model's
        raise UsageError(
            f"checkpoint {manifest} was saved with dataset {info['layout']['dataset']}, "
            f"this run has dataset {layout['dataset']}; use another --checkpoint-dir "
            "or the same dataset"
        )
    saved = info["layout"].get("optimizer")  # None: a checkpoint from before it was recorded
    if layout and saved and layout["optimizer"] and saved != layout["optimizer"]:
        raise UsageError(
            f"checkpoint {path} holds this model with --optimizer {saved}'s state, and this run "
            f"has --optimizer {layout['optimizer']}: resume with --optimizer {saved}, or, to "
            f"change optimizers, start from its weights (python -m plumbing.consolidate {path} "
            "weights.pt, then --init-from weights.pt with another --checkpoint-dir)"
        )
    for name, expected in files.items():
        try:
            actual = _fingerprint(os.path.join(path, name))
        except OSError as error:
            return None, f"{name}: {error.strerror or error}"
        if actual[0] != expected[0]:
            return None, f"{name} has {actual[0]} bytes, checkpoint.json says {expected[0]}"
        if actual != expected:
            return None, f"{name} does not match its SHA-256 in checkpoint.json"
    return info, None


def unused_path(path):  # path, or the first free path-2, path-3, ...
    taken, number = path, 1
    while os.path.lexists(taken):
        number += 1
        taken = f"{path}-{number}"
    return taken


def _fingerprint(path):  # [size in bytes, SHA-256] of a file
    with open(path, "rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    return [os.path.getsize(path), digest]
