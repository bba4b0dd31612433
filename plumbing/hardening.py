"""What a production job adds: one-line errors, dying with torchrun, signals, checkpoints. Collectives say so."""

import ctypes
import gc
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_leaves

from plumbing.core import NodeError, UsageError, cannot_write, save_json, say

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
FORMAT = 4  # of checkpoint.json: 4 holds the peak lr


def run(main, *also):
    """Run ``main()`` as a worker: under torchrun, die with it (SIGKILL, from the OOM killer or a scheduler, gives it no
    chance to stop workers, which would train on and race a restart for --checkpoint-dir; Linux's PR_SET_PDEATHSIG).
    A UsageError (or an ``also``: the data's) is one line from rank 0 (NodeError: each node's), exit code 2. Under
    torchrun a failed rank's line (a crash: its traceback) also goes to its error file, for plumbing/torchrun.py."""
    launcher = os.getppid()
    if "RANK" in os.environ and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # torchrun died before the line above took effect
            os._exit(1)
    try:
        main()
    except (UsageError, *also) as error:
        _end(f"error: {error}", 2, int(os.environ.get("LOCAL_RANK", "0")) if isinstance(error, NodeError) else None)
    except KeyboardInterrupt:  # before the training loop's StopSignals
        _end("stopped by SIGINT during start-up", 130)
    except Exception:
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            raise
        _end(traceback.format_exc().rstrip(), 1, rank=-1)  # for the launcher to print, if this rank failed first
    finally:  # FSDP's modules hold their group in reference cycles: collected now, the group and gloo's threads end
        gc.collect()  # here, not at interpreter shutdown, where one letting go of a collective's tensors would abort


def _end(line, exit_code, rank=None):
    for number in STOP_SIGNALS:  # print it and note it, or neither: torchrun may be stopping this rank meanwhile
        signal.signal(number, signal.SIG_IGN)
    said, here = say(line, rank), rank is not None or os.environ.get("GROUP_RANK", "0") == "0"  # here: its speaker
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's format (message, timestamp), and what the launcher needs
        save_json({"message": line, "timestamp": int(time.time()), "time": time.time(), "said": said, "here": here,
                   "exit_code": exit_code}, os.environ["TORCHELASTIC_ERROR_FILE"])
    sys.exit(exit_code)


class StopSignals:
    """SIGTERM (Kubernetes, SLURM, torchrun), SIGUSR1 (SLURM's warning) and SIGINT (Ctrl-C) ask for a stop: ``received``
    is the first, which the ranks compare at each logging step. A second, over a second later (not one signal sent to
    all, which torchrun passes on too), ends the process: a thread watches, as a rank blocked in a collective can't."""

    def __init__(self):
        self.received = 0
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write)  # the C-level handler writes each signal's number here, whatever Python does
        for number in STOP_SIGNALS:
            signal.signal(number, lambda *_: None)  # instead of the default action, death
        threading.Thread(target=self._watch, args=(read,), daemon=True).start()

    def _watch(self, read):
        first = None
        while True:
            for number in (n for n in os.read(read, 64) if n in STOP_SIGNALS):
                if first is None:
                    first, self.received = time.monotonic(), number
                elif time.monotonic() - first > 1:
                    say(f"{signal.Signals(number).name} again: rank {dist.get_rank()} ends now, with no checkpoint", 0)
                    os._exit(128 + number)

    @staticmethod
    def say_and_exit(number, step, total_steps, checkpoint_dir):  # exit code 128 + the signal: schedulers requeue the job
        saved = (f"checkpoint step-{step} is in {checkpoint_dir}; the same command resumes there" if checkpoint_dir
                 else "nothing was saved (no --checkpoint-dir)")
        say(f"stopped by {signal.Signals(number).name} at step {step} of {total_steps}: {saved}")
        raise SystemExit(128 + number)


class Checkpointer:
    """``step-<N>`` in --checkpoint-dir (every rank must see it): DCP's files, each rank's part by parameter name (any
    strategy resumes any other's), and checkpoint.json: layout, position, peak lr, each file's SHA-256 (none in DCP)."""

    def __init__(self, args, dataset_name, global_batch_size, device):
        self.args, self.directory, self.device = args, args.checkpoint_dir, device
        self.layout = {"dataset": dataset_name, "world_size": dist.get_world_size(),
                       "global_batch_size": global_batch_size, "device": device.type}

    def save(self, step, position, model, optimizer, peak_lr):
        """Collective: all write their part into .tmp-step-<N>; rank 0 hashes, adds checkpoint.json, renames it."""
        final, temporary = (os.path.join(self.directory, f"{prefix}step-{step}") for prefix in ("", ".tmp-"))
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state["state"],
                 "rng": {f"rank{dist.get_rank()}": self._random_states()}}
        problem = [None]
        try:
            dcp.save(state, checkpoint_id=temporary)  # raises on every rank if one rank's write fails
            if dist.get_rank() == 0:  # dcp.save returns here once every rank's files and .metadata are written
                files = {name: _fingerprint(os.path.join(temporary, name)) for name in sorted(os.listdir(temporary))}
                save_json({"format": FORMAT, "layout": self.layout, "step": step, **position, "peak_lr": peak_lr,
                           "files": files}, os.path.join(temporary, "checkpoint.json"))
                shutil.rmtree(final, ignore_errors=True)  # the same step saved before (a rerun)
                os.replace(temporary, final)
                for old in self._remove_strays_and_list_complete()[: -self.args.keep_checkpoints]:
                    shutil.rmtree(os.path.join(self.directory, old), ignore_errors=True)
        except (OSError, RuntimeError, UsageError, CheckpointException) as error:  # a full disk, a read-only directory
            cause = next(iter(getattr(error, "failures", {}).values()), [error])[0]  # DCP's: {rank: (error, trace)}
            needed = sum(getattr(t, "_local_tensor", t).nbytes for t in tree_leaves(state) if torch.is_tensor(t))
            why = cannot_write(temporary, cause, needed)
            problem[0] = (f"checkpoint step-{step} was not written to {self.directory} ({why}): the ones saved "
                          "before it are intact; fix that, and the same command resumes from them")
            shutil.rmtree(temporary, ignore_errors=True)
        dist.broadcast_object_list(problem, src=0)  # nobody exits or saves again before rank 0 is done
        if problem[0]:
            raise UsageError(problem[0])

    def _random_states(self):  # this rank's generators: the CPU's, and its GPU's when it trains on one
        return {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state(self.device)}
                                                 if self.device.type == "cuda" else {})}

    def _remove_strays_and_list_complete(self):  # deletes crashed saves' .tmp-step-<N>; complete ones, oldest first
        names = os.listdir(self.directory) if self.directory and os.path.isdir(self.directory) else []
        for stray in (n for n in names if n.startswith(".tmp-step-")):
            shutil.rmtree(os.path.join(self.directory, stray), ignore_errors=True)
        return sorted((n for n in names if n.startswith("step-") and n[5:].isdigit()), key=lambda n: int(n[5:]))

    def check_outputs_and_resume(self, model, optimizer, peak_lr, log):
        """Collective: rank 0 checks that the outputs can be written and finds the newest intact checkpoint; every rank
        loads its part. Returns where training goes on: step, epoch, samples_into_epoch."""
        verdict = [None]
        if dist.get_rank() == 0:
            try:
                self._check_outputs()
                verdict[0] = self._newest_intact(log)
            except UsageError as refusal:  # raised on every rank, after the broadcast
                verdict[0] = refusal
        dist.broadcast_object_list(verdict, src=0)
        if isinstance(verdict[0], UsageError):
            raise verdict[0]
        if verdict[0] is None:
            return {"step": 0, "epoch": 0, "samples_into_epoch": 0}
        path, info = verdict[0]
        model_state, optimizer_state = get_state_dict(model, optimizer)  # not before: it steps a fresh optimizer
        tensors = {"model": model_state, "optimizer": optimizer_state["state"]}
        if all(info["layout"].get(k) == self.layout[k] for k in ("world_size", "device")):  # random states: per rank
            tensors["rng"] = {f"rank{dist.get_rank()}": self._random_states()}
        try:
            dcp.load(tensors, checkpoint_id=path)
        except (Exception, CheckpointException) as error:  # the same on every rank (not an Exception: a BaseException)
            cause = next(iter(getattr(error, "failures", {}).values()), [error])[0]  # {rank: (exception, traceback)}
            raise UsageError(f"checkpoint {path} does not load into this run ({' '.join(str(cause).split())[:200]}): "
                             "another model's? use another --checkpoint-dir; damaged? move it away") from None
        optimizer_state["state"] = tensors["optimizer"]
        set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=optimizer_state)
        for kind, state in tensors.get("rng", {}).get(f"rank{dist.get_rank()}", {}).items():
            (torch.set_rng_state(state) if kind == "cpu" else torch.cuda.set_rng_state(state, self.device))
        log(f"resumed from {path} (step {info['step']}, epoch {info['epoch'] + 1})")
        if info["peak_lr"] != peak_lr:  # another --lr, or another global batch with --scale-lr
            log(f"the peak lr is now {peak_lr:g}, not the checkpoint's {info['peak_lr']:g}: the schedule goes on")
        saved, batch = info["samples_into_epoch"], self.layout["global_batch_size"]
        if saved % batch:  # steps start at multiples of the global batch: go back to the start before the sample
            log(f"the global batch changed from {info['layout']['global_batch_size']} to {batch}: epoch "
                f"{info['epoch'] + 1} continues at sample {saved - saved % batch}, not {saved}, so {saved % batch} "
                "samples are seen twice")
        return {**info, "samples_into_epoch": saved - saved % batch}

    def _check_outputs(self):  # on rank 0, a real write where each output goes: fail now, not after training
        args = self.args
        if args.save and args.metrics and os.path.abspath(args.save) == os.path.abspath(args.metrics):
            raise UsageError(f"--save and --metrics are both {args.save}: the metrics would replace the weights; "
                             "give two paths")
        for flag, path, folder in (("--checkpoint-dir", args.checkpoint_dir, True), ("--save", args.save, False),
                                   ("--metrics", args.metrics, False), ("--log-dir", args.log_dir, True)):
            if not path:
                continue
            try:
                if (os.path.exists(path) and os.path.isdir(path) != folder) or (not folder and path.endswith("/")):
                    raise OSError("it is a file, not a directory" if folder else "it names a directory, not a file")
                os.makedirs(directory := path if folder else os.path.dirname(os.path.abspath(path)), exist_ok=True)
                tempfile.TemporaryFile(dir=directory).close()  # a real write there, gone at once
            except OSError as error:
                raise UsageError(f"{flag} {path}: cannot write there ({error.strerror or error})") from None

    def _newest_intact(self, log):  # on rank 0: (path, checkpoint.json) or None; damaged newer ones are set aside
        damaged = []  # (path, what is wrong), newest first
        for name in reversed(self._remove_strays_and_list_complete()):
            path = os.path.join(self.directory, name)
            info, problem = _verify(path, self.layout)
            if problem is None:
                for bad, why in damaged:
                    aside = os.path.join(self.directory, "damaged-" + os.path.basename(bad))
                    aside += f"-{len(os.listdir(self.directory))}" if os.path.exists(aside) else ""
                    os.replace(bad, aside)
                    log(f"checkpoint {bad} is damaged ({why}): moved it to {aside}; resuming from an older one")
                return path, info
            damaged.append((path, problem))
        if damaged:  # nothing is moved: a torchrun restart must not start again from step 0 unsaid
            faults = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in damaged)
            raise UsageError(f"no intact checkpoint in {self.directory}: {faults}; restore one, or use another "
                             "--checkpoint-dir")


def _verify(path, layout):  # (checkpoint.json, None) if all files match it, or (None, what is damaged); or refuse
    manifest = os.path.join(path, "checkpoint.json")
    try:
        with open(manifest) as file:
            info = json.load(file)
        files = {name: [int(size), str(digest)] for name, (size, digest) in info["files"].items()}
        if ".metadata" not in files or info["format"] != FORMAT:
            raise ValueError(f"format {info['format']} (this code reads {FORMAT}), files {sorted(files)}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return None, f"checkpoint.json is unreadable: {error}"
    if info["layout"]["dataset"] != layout["dataset"]:  # another model's parameters: DCP's load says which
        raise UsageError(f"checkpoint {manifest} was saved with dataset {info['layout']['dataset']}, this run has "
                         f"dataset {layout['dataset']}; use another --checkpoint-dir or the same dataset")
    for name, expected in files.items():
        try:
            actual = _fingerprint(os.path.join(path, name))
        except OSError as error:
            return None, f"{name}: {error.strerror or error}"
        if actual != expected:
            return None, (f"{name} has {actual[0]} bytes, checkpoint.json says {expected[0]}"
                          if actual[0] != expected[0] else f"{name} does not match its SHA-256 in checkpoint.json")
    return info, None


def _fingerprint(path):  # [size in bytes, SHA-256] of a file, read in 1 MiB pieces
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while piece := file.read(1 << 20):
            digest.update(piece)
            size += len(piece)
    return [size, digest.hexdigest()]
