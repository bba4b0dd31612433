"""What a production job adds: one-line errors, dying with torchrun, signals, checkpoints. Collectives say so."""

import ctypes
import errno
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

from plumbing.core import NodeError, Retryable, UsageError, cannot_write, log, save_json, say

# The signals torchrun passes on to its workers (plumbing/torchrun.py sets the same before torch is imported).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)
RETRY_EXIT = 75  # EX_TEMPFAIL: a failure that may pass on a retry; torchrun restarts it, a bad input (2) it does not
FORMAT = 4  # of checkpoint.json: 4 holds the peak lr
# What a failed write says when the user must act: the disk or its permissions, not a passing fault.
USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR}


def run(main, *also):
    """Run ``main()`` as a worker: under torchrun, die with it (SIGKILL, from the OOM killer or a scheduler, gives it no
    chance to stop workers, which would train on and race a restart for --checkpoint-dir; Linux's PR_SET_PDEATHSIG).
    A UsageError (or an ``also``: the data's) is one line from rank 0 (NodeError: each node's), exit code 2. A failure
    that may pass on a retry (``transient``) is one line, exit code 75, which torchrun's restarts retry. Under
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
    except Exception as error:
        if line := transient(error):  # each failed rank's own line: the launcher prints the first
            _end(f"error: {line}; it may pass on a retry (exit code 75: torchrun restarts it while MAX_RESTARTS "
                 "allows)", RETRY_EXIT,
                 rank=-1 if os.environ.get("TORCHELASTIC_ERROR_FILE") else 0)
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            raise
        _end(traceback.format_exc().rstrip(), 1, rank=-1)  # for the launcher to print, if this rank failed first
    finally:  # FSDP's modules hold their group in reference cycles: collected now, the group and gloo's threads end
        gc.collect()  # here, not at interpreter shutdown, where one letting go of a collective's tensors would abort


def transient(error):
    """One line for a failure that may pass on a retry (a peer lost, a collective's error or timeout, a CUDA or NCCL
    error, an OSError other than a full disk or a permission); None for any other."""
    if isinstance(error, Retryable):
        return str(error)
    if isinstance(error, CheckpointException):  # DCP's: {rank: (exception, traceback)}
        causes = [cause for cause, _ in getattr(error, "failures", {}).values()]
        return next((f"{line} (in DCP)" for line in map(transient, causes) if line), None)
    text = " ".join(str(error).split())[:300]
    if isinstance(error, OSError):
        return None if error.errno in USER_ERRNOS else f"{type(error).__name__}: {text}"
    if isinstance(error, torch.cuda.OutOfMemoryError):  # the same batch runs out again: not a passing fault
        return None
    if isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and any(
            word in text for word in ("gloo", "NCCL", "CUDA error", "Connection", "connection", "timed out",
                                      "Timed out", "Socket"))):
        return f"a collective failed ({text})"
    return None


def _end(line, exit_code, rank=None):
    for number in STOP_SIGNALS:  # print it and note it, or neither: torchrun may be stopping this rank meanwhile
        signal.signal(number, signal.SIG_IGN)
    said, here = say(line, rank), rank is not None or os.environ.get("GROUP_RANK", "0") == "0"  # here: its speaker
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's format (message, timestamp), and what the launcher needs
        save_json({"message": line, "timestamp": int(time.time()), "time": time.time(), "said": said, "here": here,
                   "exit_code": exit_code}, os.environ["TORCHELASTIC_ERROR_FILE"])
    sys.exit(exit_code)


def store_for_this_attempt(timeout):
    """Under torchrun, which hosts the workers' store: that store, under a prefix of this attempt's own. torchrun keeps
    one store across its restarts, where a restarted worker would read the dead workers' addresses and fail
    ("Connection refused", pytorch issue 135712). None elsewhere: init_process_group reads MASTER_ADDR itself."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def on_rank_0(work, what, share=True):
    """Collective: rank 0 does ``work()`` and returns its result, on every rank with ``share`` (pickled: keep it small),
    else on rank 0 alone. Whatever rank 0 raises, every rank raises at once with the same one line (a UsageError stays
    one, a transient failure is Retryable); never are the others left waiting for a collective rank 0 will not make."""
    result, problem = None, None  # problem: (kind, line)
    if dist.get_rank() == 0:
        try:
            result = work()
        except UsageError as error:
            problem = ("usage", str(error))
        except Exception as error:  # a bug too: its traceback here, its line on every rank
            line = transient(error)
            if line is None:
                traceback.print_exc()
            problem = ("retry", line) if line else ("crash", f"rank 0 failed {what}: {type(error).__name__}: "
                                                             f"{' '.join(str(error).split())[:300]}")
    outcome = [result if share else None, problem]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1]:
        kind, line = outcome[1]
        raise {"usage": UsageError, "retry": Retryable, "crash": RuntimeError}[kind](line)
    return outcome[0] if share else result


def init_from(model, path):
    """Collective: the weights in ``path`` (a state dict saved by torch.save, or a .safetensors file) into ``model``,
    whole on every rank: rank 0 reads the file and checks its names and shapes, then broadcasts each tensor, so a node
    holds the file's weights once, not once per rank. Call it before the model is wrapped, sharded or cut."""
    expected = model.state_dict()

    def read():  # rank 0: the file's tensors, or a UsageError naming the first that does not fit
        if not os.path.isfile(path):
            raise UsageError(f"--init-from {path}: no such file")
        try:
            if path.endswith(".safetensors"):
                from safetensors.torch import load_file  # an optional package: pip install safetensors

                weights = load_file(path)
            else:  # weights_only: no pickled code runs, as it would in a DCP checkpoint's .metadata
                weights = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except ImportError:
            raise UsageError(f"--init-from {path}: reading .safetensors needs pip install safetensors") from None
        except Exception as error:  # not a state dict of tensors: torch.load's and safetensors' errors vary
            raise UsageError(f"--init-from {path} is not a file of weights ({' '.join(str(error).split())[:200]})")
        if not isinstance(weights, dict) or not all(torch.is_tensor(t) for t in weights.values()):
            raise UsageError(f"--init-from {path} holds no state dict of tensors")
        for name, tensor in expected.items():
            if name not in weights:
                raise UsageError(f"--init-from {path} does not fit this model: it has no {name}")
            if weights[name].shape != tensor.shape:
                raise UsageError(f"--init-from {path} does not fit this model: {name} is "
                                 f"{list(weights[name].shape)} there, {list(tensor.shape)} here")
        if extra := sorted(set(weights) - set(expected)):
            raise UsageError(f"--init-from {path} does not fit this model: it has {extra[0]}, which this model lacks")
        return weights

    weights = on_rank_0(read, f"reading --init-from {path}", share=False)  # None on the other ranks
    with torch.no_grad():
        for name, tensor in expected.items():
            if weights is not None:
                tensor.copy_(weights[name])
            dist.broadcast(tensor, src=0)
    if dist.get_rank() == 0:
        log(f"initialised the model from {path}; the optimizer and the lr schedule start afresh")


class StopSignals:
    """A stop signal (STOP_SIGNALS: a scheduler's SIGTERM, SLURM's SIGUSR1 warning, Ctrl-C's SIGINT, a closed terminal's
    SIGHUP, SIGQUIT) is recorded as ``received``; the ranks compare theirs about once a second of training (``due``,
    ``proposal``, ``agree``) and all stop at the same step. A second, over a second later (not one signal sent to all,
    which torchrun passes on too), ends the process: a thread watches, as a rank blocked in a collective can't."""

    SECONDS = 1.0  # of training between two agreements: the most a stop waits, beyond the step under way

    def __init__(self, rank, start_step):
        self.rank, self.received = rank, 0
        self.next_check, self.steps = start_step + 1, 1  # agree after the first step, then about once a second
        self.clock = None  # (time, step) of the last agreement
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
                    say(f"{signal.Signals(number).name} again: rank {self.rank} ends now, with no checkpoint", 0)
                    os._exit(128 + number)

    def due(self, step):  # the same answer on every rank: the step was agreed at the last agreement
        return step >= self.next_check

    def proposal(self, device):  # to all-reduce with MAX: [the signal received here or 0, -(steps to the next check)]
        return torch.tensor([self.received, -self.steps], device=device)

    def agree(self, agreed, step):
        """The signal the ranks agreed on (0: none), after ``proposal``'s all-reduce. The next agreement comes after
        the fewest steps any rank proposed; this rank proposes the steps of about SECONDS, by its clock since the last
        (at most twice as many as now, so a slow start's fast steps are not overshot)."""
        number, steps = (int(value) for value in agreed.tolist())
        now = time.monotonic()
        if self.clock and step > self.clock[1]:
            seconds_per_step = max(now - self.clock[0], 1e-9) / (step - self.clock[1])
            self.steps = int(max(1, min(2 * -steps, self.SECONDS / seconds_per_step, 1e6)))
        self.clock, self.next_check = (now, step), step - steps
        return number

    def say_and_exit(self, number, step, total_steps, checkpoint_dir):  # 128 + the signal: schedulers requeue the job
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
        self.branch = None  # (rank 0's) the --resume-from this run's checkpoints descend from, if any

    def save(self, step, position, model, optimizer, peak_lr, window_loss):
        """Collective: the ranks agree that every weight, optimizer state and ``window_loss`` (the loss since the last
        logging step) is finite, or refuse to save (``diverged``); all write their part into .tmp-step-<N>; rank 0
        hashes, adds checkpoint.json, renames it."""
        final, temporary = (os.path.join(self.directory, f"{prefix}step-{step}") for prefix in ("", ".tmp-"))
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state["state"],
                 "rng": {f"rank{dist.get_rank()}": self._random_states()}}
        local = [getattr(t, "_local_tensor", t) for t in tree_leaves(state) if torch.is_tensor(t)]
        local = [t for t in local if t.is_floating_point()] + [window_loss]
        finite = torch.stack([t.isfinite().all().to(self.device) for t in local]).all().to(torch.int32)  # one sync
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite:
            raise self.diverged(step, "a weight, an optimizer state or the loss is not finite")
        try:
            dcp.save(state, checkpoint_id=temporary)  # raises on every rank if one rank's write fails
        except (OSError, RuntimeError, CheckpointException) as error:
            raise self._not_written(step, temporary, error, state) from None

        def finish():  # rank 0, once dcp.save has returned: every rank's files and .metadata are written
            try:
                files = {name: _fingerprint(os.path.join(temporary, name)) for name in sorted(os.listdir(temporary))}
                save_json({"format": FORMAT, "layout": self.layout, "step": step, **position, "peak_lr": peak_lr,
                           "branch": self.branch, "files": files}, os.path.join(temporary, "checkpoint.json"))
                shutil.rmtree(final, ignore_errors=True)  # the same step saved before (a rerun)
                os.replace(temporary, final)
            except (OSError, UsageError) as error:
                raise self._not_written(step, temporary, error, state) from None
            for old in self._remove_strays_and_list_complete()[: -self.args.keep_checkpoints]:
                shutil.rmtree(os.path.join(self.directory, old), ignore_errors=True)

        on_rank_0(finish, f"finishing checkpoint step-{step}")  # nobody exits or saves again before rank 0 is done

    def _not_written(self, step, temporary, error, state):  # UsageError (the disk, its permissions) or Retryable
        cause = next(iter(getattr(error, "failures", {}).values()), [error])[0]  # DCP's: {rank: (error, trace)}
        needed = sum(getattr(t, "_local_tensor", t).nbytes for t in tree_leaves(state) if torch.is_tensor(t))
        why = cannot_write(temporary, cause, needed)
        shutil.rmtree(temporary, ignore_errors=True)
        os_error = cause if isinstance(cause, OSError) else cause.__context__  # torch.save may hide it (2.9: always)
        if isinstance(error, UsageError) or why.startswith("the disk is full") or (
                isinstance(os_error, OSError) and os_error.errno in USER_ERRNOS):
            return UsageError(f"checkpoint step-{step} was not written to {self.directory} ({why}): the ones saved "
                              "before it are intact; fix that, and the same command resumes from them")
        return Retryable(f"checkpoint step-{step} was not written to {self.directory} ({why}); the ones saved "
                         "before it are intact")

    def diverged(self, step, what):
        """The UsageError of a run that diverged at ``step``: it names the newest checkpoint, which is finite (save
        refuses any other), so that a rerun with a lower lr goes on from there."""
        if not self.directory:
            saved = "nothing was saved: no --checkpoint-dir"
        elif complete := self._list_complete():
            saved = (f"nothing after {complete[-1]} was saved; the same command resumes from "
                     f"{os.path.join(self.directory, complete[-1])}, which is finite, as every checkpoint is")
        else:
            saved = f"no checkpoint is in {self.directory}: a rerun starts from step 0"
        return UsageError(f"{what} at step {step}: training diverged; lower --lr or raise --warmup-steps, or it "
                          f"diverges again ({saved})")

    def _random_states(self):  # this rank's generators: the CPU's, and its GPU's when it trains on one
        return {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state(self.device)}
                                                 if self.device.type == "cuda" else {})}

    def _list_complete(self):  # the complete checkpoints' names, oldest first
        names = os.listdir(self.directory) if self.directory and os.path.isdir(self.directory) else []
        return sorted((n for n in names if n.startswith("step-") and n[5:].isdigit()), key=lambda n: int(n[5:]))

    def _remove_strays_and_list_complete(self):  # deletes crashed saves' .tmp-step-<N>; complete ones, oldest first
        names = os.listdir(self.directory) if self.directory and os.path.isdir(self.directory) else []
        for stray in (n for n in names if n.startswith(".tmp-step-")):
            shutil.rmtree(os.path.join(self.directory, stray), ignore_errors=True)
        return self._list_complete()

    def check_outputs_and_resume(self, model, optimizer, peak_lr, log):
        """Collective: rank 0 checks that the outputs can be written and finds the newest intact checkpoint (or checks
        --resume-from's); every rank loads its part. Returns where training goes on: step, epoch, samples_into_epoch."""
        found = on_rank_0(lambda: self._check_outputs() or self._newest_intact(log), "finding a checkpoint")
        if found is None:
            return {"step": 0, "epoch": 0, "samples_into_epoch": 0}
        path, info = found
        model_state, optimizer_state = get_state_dict(model, optimizer)  # not before: it steps a fresh optimizer
        tensors = {"model": model_state, "optimizer": optimizer_state["state"]}
        if all(info["layout"].get(k) == self.layout[k] for k in ("world_size", "device")):  # random states: per rank
            tensors["rng"] = {f"rank{dist.get_rank()}": self._random_states()}
        try:
            dcp.load(tensors, checkpoint_id=path)
        except (Exception, CheckpointException) as error:  # the same on every rank (not an Exception: a BaseException)
            cause = next(iter(getattr(error, "failures", {}).values()), [error])[0]  # {rank: (exception, traceback)}
            # Its files match their SHA-256s: a name or a shape that this model lacks is another model's checkpoint,
            # anything else (a peer lost, a collective's timeout) may pass on a retry.
            if isinstance(cause, (ValueError, KeyError)) or str(cause).startswith("Missing key"):
                raise UsageError(f"checkpoint {path} does not load into this run ({' '.join(str(cause).split())[:200]}"
                                 "): another model's? use another --checkpoint-dir") from None
            raise Retryable(f"checkpoint {path} was not loaded ({transient(cause) or type(cause).__name__}): it is "
                            "intact (its SHA-256s match)") from None
        optimizer_state["state"] = tensors["optimizer"]
        set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=optimizer_state)
        for kind, state in tensors.get("rng", {}).get(f"rank{dist.get_rank()}", {}).items():
            (torch.set_rng_state(state) if kind == "cpu" else torch.cuda.set_rng_state(state, self.device))
        log(f"resumed from {path} (step {info['step']}, epoch {info['epoch'] + 1})")
        if self.args.init_from:  # a restarted or requeued job goes on; it does not start over
            log(f"--init-from {self.args.init_from} is not used: the checkpoint is newer")
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

    def _newest_intact(self, log):  # on rank 0: (path, checkpoint.json) or None; --resume-from's, if given
        found, chosen = self._newest_in_directory(log), self.args.resume_from
        self.branch = found[1].get("branch") if found else None  # written into the checkpoints this run saves
        if not chosen:
            return found
        if found and self.branch == chosen:  # a rerun of the same command (a requeue, a torchrun restart)
            log(f"--resume-from {chosen} was applied before: its branch goes on from {found[0]}")
            return found
        path = chosen if os.sep in chosen else os.path.join(self.directory or ".", chosen)  # step-<N> there, or a path
        info, problem = _verify(path, self.layout)
        if problem:
            raise UsageError(f"--resume-from {chosen} is not an intact checkpoint ({problem})")
        newer = [name for name in self._list_complete() if int(name[5:]) > info["step"]]
        for name in newer:  # never resumed from again, never deleted
            os.replace(os.path.join(self.directory, name), _unused(os.path.join(self.directory, "abandoned-" + name)))
        if newer:
            log(f"--resume-from {chosen}: the newer {', '.join(newer)} moved aside to abandoned-step-<N>")
        self.branch = chosen
        return path, info

    def _newest_in_directory(self, log):  # on rank 0: (path, checkpoint.json) or None; damaged newer ones go aside
        damaged = []  # (path, what is wrong), newest first
        for name in reversed(self._remove_strays_and_list_complete()):
            path = os.path.join(self.directory, name)
            info, problem = _verify(path, self.layout)
            if problem is None:
                for bad, why in damaged:
                    aside = _unused(os.path.join(self.directory, "damaged-" + os.path.basename(bad)))
                    os.replace(bad, aside)
                    log(f"checkpoint {bad} is damaged ({why}): moved it to {aside}; resuming from an older one")
                return path, info
            damaged.append((path, problem))
        if damaged:  # nothing is moved: a torchrun restart must not start again from step 0 unsaid
            faults = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in damaged)
            raise UsageError(f"no intact checkpoint in {self.directory}: {faults}; restore one, or use another "
                             "--checkpoint-dir")


def _verify(path, layout=None):  # (checkpoint.json, None) if all files match it, or (None, what is damaged); or refuse
    manifest = os.path.join(path, "checkpoint.json")
    try:
        with open(manifest) as file:
            info = json.load(file)
        files = {name: [int(size), str(digest)] for name, (size, digest) in info["files"].items()}
        if ".metadata" not in files or info["format"] != FORMAT:
            raise ValueError(f"format {info['format']} (this code reads {FORMAT}), files {sorted(files)}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return None, f"checkpoint.json is unreadable: {error}"
    if layout and info["layout"]["dataset"] != layout["dataset"]:  # another model's parameters: DCP's load says which
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


def _unused(path):  # path, or path-2, path-3, ...: the first that does not exist
    taken = path
    for number in range(2, 1_000_000):
        if not os.path.lexists(taken):
            return taken
        taken = f"{path}-{number}"
    raise UsageError(f"{path}: a million names like it are taken; move the damaged checkpoints away")


def _fingerprint(path):  # [size in bytes, SHA-256] of a file, read in 1 MiB pieces
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while piece := file.read(1 << 20):
            digest.update(piece)
            size += len(piece)
    return [size, digest.hexdigest()]
