"""Checkpoints for all three scripts: torch.distributed.checkpoint (DCP), written atomically.

A checkpoint is a directory ``step-<N>`` inside ``--checkpoint-dir``:

* DCP files: model weights and optimizer state tensors, taken with ``get_state_dict`` under the
  model's own parameter names. Every rank writes its own part in parallel (an FSDP shard, a
  pipeline stage; replicated tensors are written once), and DCP can load them at another world
  size or sharding: a DDP checkpoint resumes under FSDP and back.
* ``checkpoint.json``: everything else, as plain JSON: the layout it was saved with, the step, the
  position inside the epoch, the optimizer's param groups and the learning-rate scheduler. No
  pickles anywhere: DCP is given tensors only (it would read anything else with
  ``torch.load(weights_only=False)``).

A save is written into ``.tmp-step-<N>`` and renamed once complete, so a crash mid-save leaves the
previous checkpoint as it was. ``checkpoint.json`` lists every file's size and SHA-256 (each rank hashes
the files it wrote): DCP has no checksum of its own, and a damaged file would otherwise load as garbage.
Loading takes the newest ``step-<N>`` whose files all match (the ranks share the reading); a damaged
one is moved aside to ``damaged-step-<N>``, never deleted, and the next older one is tried. A stray
``.tmp-*`` is ignored. The filesystem must be shared by all ranks (one directory, as on a cluster's
shared storage).
"""

import hashlib
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from models.training import UsageError

FORMAT = 3  # 2: random states per generator (the CPU, and the GPU where one trains); 3: file checksums, dataset
_NAME = re.compile(r"^step-(\d+)$")


class Checkpointer:
    """Save every --checkpoint-every steps into --checkpoint-dir, keep the newest --keep-checkpoints,
    resume from the newest.

    A checkpoint loads only into the same model (BabyCNN's shape), dataset and parallelism: DDP and
    FSDP share one ("data parallel"), so each resumes the other's, at any world size; a pipeline only
    resumes a pipeline with the same number of stages. Anything else is refused with one line
    naming the file. World size and global batch may change.
    """

    def __init__(self, args, dataset, parallelism, world_size, global_batch_size, device):
        self.directory, self.every, self.keep = args.checkpoint_dir, args.checkpoint_every, args.keep_checkpoints
        self.device = device
        model = dict(in_channels=dataset.in_channels, num_classes=dataset.num_classes, image_size=dataset.image_size,
                     width=args.width)
        self.layout = {"model": model, "dataset": dataset.name, "parallelism": parallelism, "world_size": world_size,
                       "global_batch_size": global_batch_size}
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    # ---- saving ----------------------------------------------------------------------------

    def due(self, step, stopping=False):
        """True when a checkpoint is to be written at ``step``: every --checkpoint-every steps, and on a stop."""
        return bool(self.directory) and (bool(stopping) or step % self.every == 0)

    def save(self, step, position, model, optimizer, scheduler):
        """Collective: every rank writes its part; rank 0 adds checkpoint.json and renames."""
        final = os.path.join(self.directory, f"step-{step}")
        temporary = os.path.join(self.directory, f".tmp-step-{step}")
        if self.rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)  # left by a save that crashed
            os.makedirs(temporary)
        dist.barrier()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        tensors = {"model": model_state, "optimizer": optimizer_state["state"],
                   "rng": {f"rank{self.rank}": self._random_states()}}
        dcp.save(tensors, checkpoint_id=temporary)  # returns once every rank's files and .metadata exist
        # Each rank hashes the files it wrote (DCP names them __<rank>_<n>.distcp); rank 0 also the rest.
        mine = [name for name in os.listdir(temporary) if name.startswith(f"__{self.rank}_")]
        hashed = [None] * self.world_size
        dist.all_gather_object(hashed, {name: _fingerprint(os.path.join(temporary, name)) for name in mine})
        if self.rank == 0:
            files = {name: fingerprint for part in hashed for name, fingerprint in part.items()}
            files.update({name: _fingerprint(os.path.join(temporary, name))
                          for name in os.listdir(temporary) if name not in files})
            info = {
                "format": FORMAT,
                "layout": self.layout,
                "step": step,
                **position,
                # Hyperparameters only: which parameters a group holds differs by rank (pipeline stages).
                "param_groups": [{k: v for k, v in group.items() if k != "params"}
                                 for group in optimizer_state["param_groups"]],
                "scheduler": scheduler.state_dict(),
                "random_states": sorted(self._random_states()),
                "files": dict(sorted(files.items())),
            }
            with open(os.path.join(temporary, "checkpoint.json"), "w") as file:
                json.dump(info, file, indent=2)
                file.flush()
                os.fsync(file.fileno())
            shutil.rmtree(final, ignore_errors=True)  # the same step saved before (a rerun)
            os.replace(temporary, final)
            for old in self._complete()[: -self.keep]:
                shutil.rmtree(os.path.join(self.directory, old), ignore_errors=True)
        dist.barrier()  # nobody starts the next save (or exits) before this one is in place

    def _random_states(self):
        """This rank's generators: the CPU's, and its GPU's when it trains on one (dropout, sampling)."""
        states = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self.device)
        return states

    def _set_random_states(self, states):
        torch.set_rng_state(states["cpu"])
        if "cuda" in states:
            torch.cuda.set_rng_state(states["cuda"], self.device)

    # ---- loading ---------------------------------------------------------------------------

    def _complete(self):
        """Names of complete checkpoints, oldest first."""
        if not self.directory or not os.path.isdir(self.directory):
            return []
        names = [n for n in os.listdir(self.directory) if _NAME.match(n)]
        return sorted(names, key=lambda n: int(_NAME.match(n).group(1)))

    def resume(self, model, optimizer, scheduler, log):
        """Load the newest intact checkpoint, if any. Returns where training continues: its checkpoint.json
        (step, epoch, samples_into_epoch), or the start of training when there is none."""
        names = [self._complete() if self.rank == 0 else None]
        dist.broadcast_object_list(names, src=0)
        damaged = []  # (path, what is wrong), newest first
        for name in reversed(names[0]):
            path = os.path.join(self.directory, name)
            verdict = [self._read_manifest(path) if self.rank == 0 else None]
            dist.broadcast_object_list(verdict, src=0)
            info, problem, refusal = verdict[0]
            if refusal:
                raise UsageError(refusal)
            if problem is None:
                problem = self._verify(path, info["files"])
            if problem is None:
                break
            damaged.append((path, problem))
        else:
            if damaged:
                raise UsageError(f"no intact checkpoint in {self.directory}: " +
                                 "; ".join(f"{os.path.basename(p)}: {why}" for p, why in damaged) +
                                 "; restore one, or use another --checkpoint-dir to start afresh")
            return {"step": 0, "epoch": 0, "samples_into_epoch": 0}
        for bad, why in damaged:  # an intact one is older: set the damaged ones aside, for a person to look at
            if self.rank == 0:
                aside = _free_name(os.path.join(self.directory, "damaged-" + os.path.basename(bad)))
                os.replace(bad, aside)
                log(f"checkpoint {bad} is damaged ({why}): moved it to {aside}; resuming from an older one")
        self._load(path, info, model, optimizer, scheduler)
        log(f"resumed from {path} (step {info['step']}, epoch {info['epoch'] + 1})")
        return self._position(info, log)

    def _load(self, path, info, model, optimizer, scheduler):
        model_state, optimizer_state = get_state_dict(model, optimizer)
        tensors = {"model": model_state, "optimizer": optimizer_state["state"]}
        same_world = info["layout"]["world_size"] == self.layout["world_size"]
        # Random states are per rank, so only meaningful at the same world size; and only the
        # generators both runs use (a checkpoint saved on CPUs has no GPU state).
        states = {kind: state for kind, state in self._random_states().items() if kind in info["random_states"]}
        if same_world:
            tensors["rng"] = {f"rank{self.rank}": states}
        try:
            dcp.load(tensors, checkpoint_id=path)
        except (Exception, CheckpointException) as error:  # DCP raises the same CheckpointException on every rank
            failures = getattr(error, "failures", None)  # {rank: (exception, traceback)}: keep the first cause
            cause = next(iter(failures.values()))[0] if failures else error
            reason = " ".join(str(cause).split())[:160]
            raise UsageError(f"checkpoint {path} is unreadable ({type(cause).__name__}: {reason}); "
                             "move it away to resume from an older one") from None
        groups = [{**saved, "params": mine["params"]}
                  for saved, mine in zip(info["param_groups"], optimizer_state["param_groups"])]
        set_state_dict(model, optimizer, model_state_dict=tensors["model"],
                       optim_state_dict={"state": tensors["optimizer"], "param_groups": groups})
        scheduler.load_state_dict(info["scheduler"])
        if same_world:
            self._set_random_states(tensors["rng"][f"rank{self.rank}"])

    def _position(self, info, log):
        """Where this run continues in the epoch. Steps start at multiples of the global batch, so with
        another global batch the run goes back to the last step start at or before the saved sample:
        those few samples (fewer than one global batch) are trained on a second time."""
        saved, batch = info["samples_into_epoch"], self.layout["global_batch_size"]
        start = saved // batch * batch
        if start != saved:
            log(f"the global batch changed from {info['layout']['global_batch_size']} to {batch}: epoch "
                f"{info['epoch'] + 1} continues at sample {start}, not {saved}, so {saved - start} samples are seen twice")
        return {**info, "samples_into_epoch": start}

    def _verify(self, path, files):
        """Collective: every rank checks a share of the files against checkpoint.json; the first problem or None."""
        problems = [None] * self.world_size
        mine = sorted(files)[self.rank :: self.world_size]
        dist.all_gather_object(problems, next(filter(None, (_mismatch(path, n, files[n]) for n in mine)), None))
        return next(filter(None, problems), None)

    def _read_manifest(self, path):
        """On rank 0: (checkpoint.json, what is damaged or None, why this run cannot use it or None)."""
        manifest = os.path.join(path, "checkpoint.json")
        try:
            with open(manifest) as file:
                info = json.load(file)
            saved, files = info["layout"], info.get("files")
        except (OSError, ValueError, KeyError, TypeError) as error:
            return None, f"checkpoint.json is unreadable: {error}", None
        if info.get("format") != FORMAT:
            return info, None, (f"checkpoint {manifest} has format {info.get('format')}, this code reads format "
                                f"{FORMAT}; use another --checkpoint-dir")
        if not isinstance(files, dict) or ".metadata" not in files:
            return None, "checkpoint.json lists no .metadata file", None
        if not all(isinstance(entry, list) and len(entry) == 2 for entry in files.values()):
            return None, "checkpoint.json lists files without [size, SHA-256]", None  # else ranks would fail apart
        for key in ("model", "dataset", "parallelism"):
            if saved.get(key) != self.layout.get(key):
                return info, None, (f"checkpoint {manifest} was saved with {key} {saved.get(key)}, "
                                    f"this run has {key} {self.layout.get(key)}; "
                                    f"use another --checkpoint-dir or the same {key}")
        return info, None, None


def _fingerprint(path):
    """[size in bytes, SHA-256] of a file, read in 1 MiB pieces."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while piece := file.read(1 << 20):
            digest.update(piece)
            size += len(piece)
    return [size, digest.hexdigest()]


def _mismatch(path, name, expected):
    """What is wrong with file ``name`` of checkpoint ``path`` against its [size, SHA-256], or None."""
    try:
        size, digest = _fingerprint(os.path.join(path, name))
    except OSError as error:
        return f"{name}: {error.strerror or error}"
    if size != expected[0]:
        return f"{name} has {size} bytes, checkpoint.json says {expected[0]}"
    if digest != expected[1]:
        return f"{name} does not match its SHA-256 in checkpoint.json"
    return None


def _free_name(path):
    """``path``, or ``path-2``, ``path-3``... whichever does not exist yet."""
    candidate, number = path, 1
    while os.path.exists(candidate):
        number += 1
        candidate = f"{path}-{number}"
    return candidate
