"""--checkpoint-dir DIR: checkpoints every --checkpoint-every steps, at a stop and at the end, and
the newest intact one resumed; --resume-from STEP: resume from step-<N> or a path, not the newest
(opt-in: imported only when either flag is given, so a copy without this file refuses them in one
line)."""

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_leaves

from plumbing.failures import (
    INPUT_ERRNOS,
    USER_ERRNOS,
    Retryable,
    UsageError,
    on_rank_0,
    transient,
)
from plumbing.outputs import cannot_write, diverged, save_json
from plumbing.training import START

FORMAT = 5  # of checkpoint.json: 4 holds the peak lr, 5 block sums, not SHA-256s (both read)
CHECKSUM, BLOCK = "block-sums", 1 << 20  # a file's checksum (_fingerprint), and its block
HISTORY = "history.json"  # in --checkpoint-dir: the checkpoints pruned and those set aside
WRITER = re.compile(r"__(\d+)_")  # DCP's FileSystemWriter names a rank's files __<rank>_<n>.distcp


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
    resumes any other's), and checkpoint.json with their checksums."""

    def __init__(self, args, plan, device):
        self.args, self.directory, self.device = args, args.checkpoint_dir, device
        self.peak_lr, self.total_steps = plan.peak_lr, plan.total_steps
        self.layout = {"dataset": plan.dataset_name, "world_size": dist.get_world_size()}
        self.layout |= {"global_batch_size": plan.global_batch_size, "device": device.type}
        self.layout["optimizer"] = getattr(args, "optimizer", None)  # its state must be the same
        self.branch = None  # the --resume-from it descends from
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
        checked = [t for t in _local(state) if t.is_floating_point() and t.numel()] + list(losses)
        # Their ends: NaN and inf reach aminmax's; isfinite() made a bool the size of each (page
        # faults: most of a save's time on a CPU, docs/measurements.md)
        ends = [torch.stack(torch.aminmax(t)).isfinite().all().to(self.device) for t in checked]
        finite = torch.stack(ends).all()
        finite = finite.to(torch.int32)  # one sync for them all
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite:
            raise diverged(step, "a weight, an optimizer state or the loss is not finite", self)
        try:
            with warnings.catch_warnings():  # torch 2.9's DCP warns of its own .storage() call
                warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
                dcp.save(state, checkpoint_id=temporary)  # one rank fails: all raise
        except (OSError, RuntimeError, CheckpointException) as error:
            raise self._not_written(step, temporary, error, state) from None
        rank, world_size = dist.get_rank(), dist.get_world_size()
        try:  # each rank the files it wrote, all at once: no rank reads another's
            mine = [n for n in sorted(os.listdir(temporary)) if checked_by(n, world_size) == rank]
            hashed = {name: _fingerprint(os.path.join(temporary, name)) for name in mine}, None
        except OSError as error:
            hashed = {}, error
        shares = from_every_rank(hashed)  # collective
        if failed := next((error for _, error in shares if error), None):
            raise self._not_written(step, temporary, failed, state)

        def finish():  # rank 0, once every rank's files are written and hashed
            try:
                files = dict(sorted(kv for share, _ in shares for kv in share.items()))
                done = steps_into_epoch * self.layout["global_batch_size"]
                info = {"format": FORMAT, "layout": self.layout, "step": step, "epoch": epoch}
                info |= {"samples_into_epoch": done, "peak_lr": self.peak_lr}
                info |= {"branch": self.branch, "checksum": CHECKSUM, "files": files}
                save_json(info, os.path.join(temporary, "checkpoint.json"))
                shutil.rmtree(final, ignore_errors=True)  # a rerun saved it before
                os.replace(temporary, final)
            except (OSError, UsageError) as error:
                raise self._not_written(step, temporary, error, state) from None
            self._remove_strays()
            if pruned := self.complete()[: -self.args.keep_checkpoints]:
                record(self.directory, "pruned", {name: step for name in pruned})  # first
            for old in pruned:
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

    def resume(self, model, optimizer, log, tied=()):
        """Collective: load the newest intact checkpoint, if any, with each rank's random
        states; where to go on. ``tied``: the weights a pipeline's stages share, each with its
        ``names`` in the whole model; a checkpoint keeps one optimizer state of each, by its first
        name (the one one process gives it), here and in every save (_renamed)."""
        self.aliases = {name: weight.names[0] for weight in tied for name in weight.names[1:]}
        self._check_shared()  # collective
        found = self._newest_intact(log)  # collective
        if found is None:
            return START
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
            line = f"checkpoint {path} was not loaded ({why}): it is intact (its checksums match)"
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
        """Collective: (path, checkpoint.json) or None; --resume-from's, if given."""
        found = self._newest_in_directory(log)
        self.branch = found[1].get("branch") if found else None  # its checkpoints keep it
        return self._resume_from(found, log) if self.args.resume_from else found

    def _resume_from(self, found, log):
        """Collective: --resume-from's checkpoint (path, checkpoint.json), or ``found`` (the
        newest in --checkpoint-dir) when it descends from the chosen one: a requeue goes on, not
        back. The checkpoints newer than the chosen one move aside, never resumed from again,
        never deleted."""
        chosen = self.args.resume_from
        if found and found[1].get("branch") == chosen:  # a requeue or a restart
            log(f"--resume-from {chosen} was applied before: its branch goes on from {found[0]}")
            return found
        path = chosen if os.sep in chosen else os.path.join(self.directory or ".", chosen)

        def there():  # on rank 0
            if not os.path.isdir(path):
                raise UsageError(self._not_found(chosen, path))

        on_rank_0(there, f"finding --resume-from {chosen}")
        info, problem = self.intact(path)  # collective; a read error raises
        if problem:
            raise UsageError(f"--resume-from {chosen} is not an intact checkpoint ({problem})")
        on_rank_0(
            lambda: self._set_aside_newer(chosen, info["step"], log), "moving newer ones aside"
        )
        self.branch = chosen
        return path, info

    def _set_aside_newer(self, chosen, step, log):  # on rank 0
        newer = [name for name in self.complete() if int(name[5:]) > step]
        for name in newer:
            aside = unused_path(os.path.join(self.directory, "abandoned-" + name))
            os.replace(os.path.join(self.directory, name), aside)
        if newer:
            moved = ", ".join(newer)
            log(f"--resume-from {chosen}: the newer {moved} moved aside to abandoned-step-<N>")

    def _not_found(self, chosen, path):
        """The line for a ``path`` that is not there: the checkpoints that are, and, if the folder
        records it, that --keep-checkpoints pruned it."""
        folder, name = os.path.split(os.path.normpath(path))
        found = complete(folder or ".")
        line = f"--resume-from {chosen}: no such checkpoint; {folder or '.'} holds "
        line += f"{', '.join(found)}: resume from one of those" if found else "none"
        if name in history(folder or ".").get("pruned", {}):
            keep = self.args.keep_checkpoints
            line += f" ({name} was pruned: --keep-checkpoints {keep} keeps the newest {keep}; "
            line += "raise it to keep more)"
        return line

    def intact(self, path):
        """Collective: (checkpoint.json, None) if every file of ``path`` is whole and matches its
        checksum, or (None, what is damaged). Each rank checks the files it wrote (at another world
        size, rank % world_size's), at once. A read error is not damage: every rank raises it."""
        info, problem = on_rank_0(lambda: read_manifest(path, self.layout), f"reading {path}")
        if problem:
            return None, problem
        rank, world_size = dist.get_rank(), dist.get_world_size()
        mine = [name for name in sorted(info["files"]) if checked_by(name, world_size) == rank]
        try:
            outcome = check_files(path, info["files"], mine, info["checksum"])  # None, or damage
        except OSError as error:
            outcome = error
        outcomes = from_every_rank(outcome)  # collective
        if damage := next((o for o in outcomes if isinstance(o, str)), None):
            return None, damage
        if error := next((o for o in outcomes if isinstance(o, OSError)), None):
            raise unreadable(path, error)
        return info, None

    def _newest_in_directory(self, log):
        """Collective: (path, checkpoint.json) or None; newer damaged ones go aside."""
        names, set_aside = on_rank_0(self._start, "listing the checkpoints")
        for aside, why in set_aside:  # said on every start until it is deleted
            log(f"checkpoint {aside} was set aside as damaged ({why}): delete it once looked at")
        damaged = []  # (name, what is wrong), newest first
        for name in reversed(names):
            path = os.path.join(self.directory, name)
            info, problem = self.intact(path)
            if problem is None:
                on_rank_0(lambda: self._set_aside(damaged, log), "moving damaged checkpoints")
                return path, info
            damaged.append((name, problem))
        if damaged:  # none moved: a restart must not go back to step 0 unsaid
            faults = "; ".join(f"{bad}: {why}" for bad, why in damaged)
            raise UsageError(
                f"no intact checkpoint in {self.directory}: {faults}; restore one, "
                "or use another --checkpoint-dir"
            )

    def _start(self):
        """On rank 0: the complete checkpoints, oldest first, then [(damaged-step-<N>, why)]."""
        self._remove_strays()
        reasons = history(self.directory).get("damaged", {})
        aside = [n for n in sorted(_names(self.directory)) if n.startswith("damaged-step-")]
        paths = [os.path.join(self.directory, n) for n in aside]
        return self.complete(), [(p, reasons.get(n, "unrecorded")) for p, n in zip(paths, aside)]

    def _set_aside(self, damaged, log):  # on rank 0: each damaged-step-<N>, never deleted
        for name, why in damaged:
            bad = os.path.join(self.directory, name)
            aside = unused_path(os.path.join(self.directory, "damaged-" + name))
            record(self.directory, "damaged", {os.path.basename(aside): why})  # first
            os.replace(bad, aside)
            log(
                f"checkpoint {bad} is damaged ({why}): moved it to {aside}; "
                "resuming from an older one"
            )


def from_every_rank(value):
    """Collective: every rank's ``value``, in rank order."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _names(folder):
    return os.listdir(folder) if folder and os.path.isdir(folder) else []


def newest(directory):
    """``directory`` if it is a checkpoint (it has checkpoint.json), else its newest step-<N>."""
    if not os.path.isdir(directory):
        raise UsageError(f"{directory} is not a directory: give a step-<N> or a --checkpoint-dir")
    if os.path.exists(os.path.join(directory, "checkpoint.json")):
        return directory
    if not (steps := complete(directory)):
        raise UsageError(
            f"{directory} is not a checkpoint: it has no checkpoint.json and no step-<N>"
        )
    return os.path.join(directory, steps[-1])


def complete(folder):
    """The complete checkpoints in ``folder``, oldest first: only a finished save is named
    step-<N>, renamed from .tmp-step-<N> once written."""
    names = [n for n in _names(folder) if n.startswith("step-") and n[5:].isdigit()]
    return sorted(names, key=lambda name: int(name[5:]))


def verify(path, layout=None):
    """One process: (checkpoint.json, None) if every file matches, or (None, what is damaged); a
    read error raises (``unreadable``)."""
    info, problem = read_manifest(path, layout)
    if problem:
        return None, problem
    try:
        problem = check_files(path, info["files"], sorted(info["files"]), info["checksum"])
    except OSError as error:
        raise unreadable(path, error) from None
    return (None, problem) if problem else (info, None)


def read_manifest(path, layout=None):
    """(checkpoint.json, None), or (None, what is damaged): missing, unparsable, another format.
    Another dataset or optimizer is a UsageError; a read error raises (``unreadable``)."""
    manifest = os.path.join(path, "checkpoint.json")
    try:
        with open(manifest) as file:
            info = json.load(file)
        files = {name: [int(size), str(digest)] for name, (size, digest) in info["files"].items()}
        checksum = {4: "sha256", FORMAT: info.get("checksum")}.get(info["format"])  # 4 names none
        if ".metadata" not in files or checksum not in ("sha256", CHECKSUM):
            found = f"format {info['format']}, checksum {checksum} (this code reads 4 with sha256"
            raise ValueError(f"{found} and {FORMAT} with {CHECKSUM}), files {sorted(files)}")
    except OSError as error:
        if error.errno != errno.ENOENT:
            raise unreadable(path, error) from None
        return None, f"checkpoint.json is unreadable: {error}"
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return None, f"checkpoint.json is unreadable: {error}"
    info["files"], info["checksum"] = files, checksum
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
    return info, None


def check_files(path, files, names, checksum=CHECKSUM):
    """None if each of ``names`` is whole and matches ``files`` ({name: [size, checksum]}), or what
    is damaged: missing, truncated, another checksum. A read error raises its OSError, named."""
    for name in names:
        expected, file = files[name], os.path.join(path, name)
        try:
            actual = _fingerprint(file, checksum)
        except OSError as error:
            if error.errno == errno.ENOENT:  # not whole: a file of it is gone
                return f"{name}: {error.strerror}"
            error.filename = error.filename or file  # a read's error names no file
            raise
        if actual[0] != expected[0]:
            return f"{name} has {actual[0]} bytes, checkpoint.json says {expected[0]}"
        if actual != expected:
            return f"{name} does not match its checksum in checkpoint.json"
    return None


def checked_by(name, world_size):
    """The rank that hashes file ``name`` of a checkpoint: the one that wrote it (DCP's
    __<rank>_<n>.distcp; .metadata and checkpoint.json are rank 0's), or rank % world_size."""
    writer = WRITER.match(name)
    return int(writer.group(1)) % world_size if writer else 0


def unreadable(path, error):
    """A read error is the environment's, not damage: nothing is moved aside or skipped for it. A
    UsageError for one the user fixes (missing, a permission, a directory in a file's place), else a
    Retryable (EIO, ESTALE: exit 75)."""
    line = f"checkpoint {path}: {error.filename} cannot be read ({error.strerror or error})"
    line += ": a read error, not damage; no checkpoint was moved aside or skipped"
    if error.errno in INPUT_ERRNOS:
        return UsageError(f"{line}; fix that, and the same command resumes from it")
    return Retryable(line)


def history(folder):
    """--checkpoint-dir's record: {"pruned": {step-<N>: the step that pruned it},
    "damaged": {damaged-step-<N>: why}}."""
    try:
        with open(os.path.join(folder, HISTORY)) as file:
            return json.load(file)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):  # a record, not a checkpoint: a bad one is said, not fatal
        return {"unreadable": True}


def record(folder, kind, entries):  # on rank 0: added to the folder's history, if it can be
    known = history(folder)
    known.pop("unreadable", None)
    known[kind] = known.get(kind, {}) | entries
    try:
        save_json(known, os.path.join(folder, HISTORY))
    except UsageError:  # a full disk: the checkpoints matter, not their record
        pass


def unused_path(path):  # path, or the first free path-2, path-3, ...
    taken, number = path, 1
    while os.path.lexists(taken):
        number += 1
        taken = f"{path}-{number}"
    return taken


def _fingerprint(path, checksum=CHECKSUM):
    """[size in bytes, checksum] of a file: "block-sums" (format 5's), or "sha256" (format 4's)."""
    with open(path, "rb") as file:
        if checksum == "sha256":
            return [os.path.getsize(path), hashlib.file_digest(file, "sha256").hexdigest()]
        # Each MiB's 64-bit words summed (wrapping: any order gives the same sum; little-endian,
        # as on x86 and ARM), the sums SHA-256'd in order. For accidental damage, not forgery
        # (whoever writes a file rewrites checkpoint.json too): a changed byte always changes its
        # block's sum (by d * 256**k mod 2**64 != 0), a truncation the size, a moved or foreign
        # block the SHA-256; only changes that cancel in one MiB's sum pass. 7x SHA-256's speed
        # here, which took as long as DCP's own load (docs/measurements.md); zlib's CRC-32 ran at
        # most 2x SHA-256's (timed by hand).
        block = bytearray(BLOCK)
        words, sums, size = torch.frombuffer(block, dtype=torch.int64), hashlib.sha256(), 0
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a MiB's sum: more threads waited on each other, 20x slower
        try:
            while read := file.readinto(block):  # a buffered file's: full up to its end
                block[read : -read % 8 + read] = bytes(-read % 8)  # the last word padded
                total = int(words[: -(-read // 8)].sum())
                sums.update(total.to_bytes(8, "little", signed=True))
                size += read
        finally:
            torch.set_num_threads(threads)
    return [size, sums.hexdigest()]
