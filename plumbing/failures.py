"""Failures and signals: one-line errors, exit codes, dying with torchrun, agreed stops."""

import ctypes
import errno
import gc
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

# The signals torchrun passes on to its workers (launch_torchrun.py lists the same).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)
RETRY_EXIT = 75  # EX_TEMPFAIL: torchrun restarts it, not a bad input's 2
# Seconds in which a second stop signal is the same stop: GNU timeout signals its child and then
# its group, scancel every process of a step, torchrun passes it on (docs/reference.md: measured).
STOP_GRACE = 2.0
# A failed write the user must fix (the disk, its permissions), not a passing fault.
USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR}
USER_ERRNOS |= {errno.EISDIR}
# Reading the user's own input: also a file or folder that is not there.
INPUT_ERRNOS = USER_ERRNOS | {errno.ENOENT, errno.ENAMETOOLONG, errno.ELOOP}
DIST_ERROR = dist.DistError  # DistBackendError, DistNetworkError, DistStoreError
GLOO_SOURCE = re.compile(r"\[\S*gloo/\S*:\d+\]")  # starts gloo's errors, plain RuntimeErrors
TORCH = os.path.dirname(torch.__file__) + os.sep  # its files: where an error was raised
# AcceleratorError.error_code, CUDA's cudaError_t: a fault of the hardware may pass on a retry (a
# busy or lost GPU, an uncorrectable ECC or NVLink error), a kernel's never does (an assert, an
# illegal address, instruction or program counter).
CUDA_TRANSIENT, CUDA_BUGS = {46, 100, 214, 220}, {700, 710, 715, 716, 717, 718}
LIKELY = "most likely a token id outside the model's vocabulary, or a label outside its classes"


class UsageError(Exception):
    """What the user must fix: one line from rank 0, exit code 2."""


class NodeError(UsageError):
    """A problem of one node (its GPUs), found before the process group: each node says it."""


class Retryable(Exception):
    """What may pass on a retry (a peer lost, an I/O error): one line, exit code 75."""


class InputError(UsageError):
    """The user's input (data, --init-from) missing or unreadable: exit 2. A DataLoader re-raises a
    worker's error as its type called with the worker's traceback, whose last line is this one's."""

    def __init__(self, line):
        Exception.__init__(self, line.rstrip().rpartition(f"{__name__}.{type(self).__name__}: ")[2])


class InputRetry(Retryable):  # reading it failed in the storage (EIO, ESTALE): exit 75
    __init__ = InputError.__init__


def input_error(error, what):
    """The line for an OSError reading the user's ``what``, naming the file and the error: exit 2
    (missing, a permission, not a file; no errno: its contents, as PIL's), or 75 (the storage's)."""
    name, why = error.filename or "a file", error.strerror or str(error) or type(error).__name__
    if error.errno is None or error.errno in INPUT_ERRNOS:
        return InputError(f"{what}: {name} cannot be read ({why}): fix it, or the path to it")
    return InputRetry(f"{what}: reading {name} failed ({why})")


class Stopped(Exception):
    """A stop signal the ranks agreed on: its line, and exit code 128 + the signal."""


def is_rank_0():  # the one gate for rank 0's own output; torchrun sets RANK
    return int(os.environ.get("RANK", "0")) == 0


def say(line, rank=None):
    """``line`` on stderr from rank 0 (or ``rank`` 0), naming torchrun's restart."""
    if not (is_rank_0() if rank is None else rank == 0):
        return False
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(line + (f" (torchrun restart {restart})" if restart else ""), file=sys.stderr, flush=True)
    return True


def run(main, *also):
    """``main()``, then the process group's end: one line and an exit code (2: a UsageError, an
    ``also`` or ``bug_or_bad_data``; 75: ``transient``; 1: a crash; 128 + a signal)."""
    die_with_torchrun()
    ending, problem = None, None  # (line, exit code, the rank that says it); what raised
    try:
        main()
    except (UsageError, *also) as error:
        node = int(os.environ.get("LOCAL_RANK", "0")) if isinstance(error, NodeError) else None
        ending, problem = (f"error: {error}", 2, node), error
    except Stopped as stop:  # noted: the launcher keeps its exit code, and says it if no one did
        ending, problem = (*stop.args, None), stop
    except KeyboardInterrupt as error:  # before the training loop's StopSignals
        ending, problem = ("stopped by SIGINT during start-up", 130, None), error
    except Exception as error:
        problem = error
        under_torchrun = bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))
        if cause := transient(error):  # each rank's: the launcher prints the first
            why = "exit code 75: torchrun restarts it while MAX_RESTARTS allows"
            line = f"error: {cause}; it may pass on a retry ({why})"
            ending = (line, RETRY_EXIT, -1 if under_torchrun else 0, cause)
        elif line := bug_or_bad_data(error):  # each rank's: the launcher prints the first
            ending = (f"error: {line}", 2, -1 if under_torchrun else 0)
        elif under_torchrun:  # for the launcher, if this rank failed first
            ending = (traceback.format_exc().rstrip(), 1, -1)
        else:  # plain python: its traceback, main's objects gone first
            traceback.clear_frames(error.__traceback__)
            _end_process_group(problem)
            raise
    if problem is not None:  # its frames hold main's objects (the progress bar): gone first
        # A DataLoader's SIGCHLD handler would raise, mid-teardown, for a worker torchrun stopped
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        problem.__traceback__ = None
    _end_process_group(problem)
    if ending:
        _end(*ending)


def ends_together(problem, world_size):
    """Whether to destroy the process group: not after one rank's own error, as NCCL's destroy
    waits for peers in a collective it never joins (torchtitan PR 1342); torchrun stops them."""
    return problem is None or isinstance(problem, Stopped) or world_size == 1


def _end_process_group(problem):
    # FSDP's objects sit in reference cycles: collected before the group and gloo's threads end.
    gc.collect()
    if dist.is_initialized() and ends_together(problem, dist.get_world_size()):
        dist.destroy_process_group()


def die_with_torchrun():
    """Die with torchrun (Linux): a SIGKILLed torchrun's workers would race its restart."""
    launcher = os.getppid()
    if "RANK" in os.environ and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # torchrun died before that took effect
            os._exit(1)


def transient(error):
    """One line for a failure that may pass on a retry, else None. By its type, never by words in
    its text: torch.distributed's errors (gloo's carry its source file), an OSError not the user's,
    a CUDA error of the hardware, a DataLoader's lost or stalled worker."""
    if isinstance(error, Retryable):
        return str(error)
    if isinstance(error, CheckpointException):  # DCP's: {rank: (exception, traceback)}
        causes = [cause for cause, _ in getattr(error, "failures", {}).values()]
        return next((f"{line} (in DCP)" for line in map(transient, causes) if line), None)
    text = " ".join(str(error).split())[:300]
    if isinstance(error, OSError):
        return None if error.errno in USER_ERRNOS else f"{type(error).__name__}: {text}"
    if isinstance(error, torch.AcceleratorError):
        return f"the GPU failed ({text})" if _cuda_code(error) in CUDA_TRANSIENT else None
    if isinstance(error, DIST_ERROR) or (type(error) is RuntimeError and GLOO_SOURCE.match(text)):
        return f"a collective failed ({text})"
    if type(error) is RuntimeError and _raised_in(error, os.path.join("utils", "data", "")):
        # the DataLoader's own: a worker that timed out or died, not what its Dataset raised
        return f"a DataLoader worker of this rank failed ({text}): slow storage, or out of memory?"
    return None


def bug_or_bad_data(error):
    """One line for what a retry repeats, else None: a CUDA kernel's fault (a device-side assert, an
    illegal memory access) or an IndexError, most often bad data the model indexes with."""
    line = "a bug or bad data, which a retry repeats (not retried)"
    if isinstance(error, torch.AcceleratorError) and _cuda_code(error) in CUDA_BUGS:
        what = str(error).strip().splitlines()[0]
        hint = "CUDA_LAUNCH_BLOCKING=1 makes the error name the operation that raised it"
        return f"{what}: {line}: {LIKELY}; {hint}"
    if isinstance(error, IndexError):  # torch's (an embedding's, a loss's): data out of range
        what = " ".join(str(error).split())[:200].rstrip(".")
        likely = f": {LIKELY}" if _raised_in(error) else ""
        return f"IndexError: {what}{_where(error)}: {line}{likely}"
    return None


def _cuda_code(error):  # cudaError_t; without one (not torch's own), CUDA's words for an assert
    assert_words = "CUDA error: device-side assert triggered" in str(error)
    return getattr(error, "error_code", 710 if assert_words else None)


def _raised_in(error, package=""):  # whether the innermost frame is in torch's ``package``
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(TORCH + package)


def _where(error):  # ", at FILE:LINE (FUNCTION)": the innermost frame outside torch
    frames = [f for f in traceback.extract_tb(error.__traceback__) if TORCH not in f.filename]
    path = frames and os.path.relpath(frames[-1].filename)
    path = frames and (frames[-1].filename if path.startswith("..") else path)
    return f", at {path}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def _end(line, exit_code, rank, cause=None):
    """Say and note ``line`` (and ``cause``, its short form, for the launcher's restart line); exit
    with no shutdown, which stray threads could abort."""
    for number in STOP_SIGNALS:  # torchrun may be stopping it: all or nothing
        signal.signal(number, signal.SIG_IGN)
    said = say(line, rank)
    here = rank is not None or os.environ.get("GROUP_RANK", "0") == "0"  # its node speaks
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:  # torchrun's format, and what the launcher reads
        info = {"message": line, "timestamp": int(time.time()), "time": time.time()}
        info |= {"said": said, "here": here, "exit_code": exit_code}
        info["cause"] = cause or line.splitlines()[-1].removeprefix("error: ")  # a traceback's last
        with open(path + ".tmp", "w") as file:  # never half a note
            json.dump(info, file)
        os.replace(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def process_group_options(device):
    """init_process_group's options: torchrun's ranks and store, or a group of one."""
    timeout = timedelta(minutes=10)  # a collective that waits longer fails: no hang
    if "RANK" not in os.environ:  # plain python: every collective runs unchanged
        return dict(store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device_id = device if device.type != "cpu" else None  # a GPU's group connects at once
    store = _store_for_this_attempt(timeout)
    return dict(store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id)


def _store_for_this_attempt(timeout):
    """torchrun's store, prefixed by this attempt (None: env://): its one store outlives restarts,
    and a restart would dial dead workers ("Connection refused", pytorch issue 135712)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt-{attempt}/", store)


def on_rank_0(work, what):
    """Collective: rank 0 runs ``work()``; its result on every rank.
    What rank 0 raises, all raise at once: none waits for a collective it skips."""
    result, problem = None, None  # problem: the error every rank raises
    if dist.get_rank() == 0:
        try:
            result = work()
        except UsageError as error:
            problem = UsageError(str(error))
        except Exception as error:  # a bug: its traceback here, its line everywhere
            if line := transient(error):
                problem = Retryable(line)
            else:
                traceback.print_exc()
                text = " ".join(str(error).split())[:300]
                problem = RuntimeError(f"rank 0 failed {what}: {type(error).__name__}: {text}")
    outcome = [result, problem]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1]:
        raise outcome[1]
    return outcome[0]


class StopSignals:
    """Stop signals (SIGTERM, SLURM's SIGUSR1, Ctrl-C, a closed terminal), the ranks' agreed
    stop. A second, STOP_GRACE later, ends it: a thread watches, as a blocked rank can't."""

    SECONDS = 1.0  # of training between two agreements: the most a stop waits

    def __init__(self, start_step):
        self.received = self.agreed = 0
        self.next_check, self.steps = start_step + 1, 1  # the first step, then each second
        self.clock = None  # (time, step) of the last agreement
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write)  # the C handler writes each signal's number here
        for number in STOP_SIGNALS:
            signal.signal(number, lambda *_: None)  # instead of the default action, death
        threading.Thread(target=self._watch, args=(read,), daemon=True).start()

    def _watch(self, read):
        first = None
        while True:
            for number in (n for n in os.read(read, 64) if n in STOP_SIGNALS):
                if first is None:
                    first, self.received = time.monotonic(), number
                elif time.monotonic() - first > STOP_GRACE:
                    rank, name = os.environ.get("RANK", "0"), signal.Signals(number).name
                    say(f"{name} again: rank {rank} ends now, with no checkpoint", 0)
                    os._exit(128 + number)

    def agree_now(self, step, logging_step, device):
        """Collective at ``logging_step``s and about each second: the signal to stop on, or 0.
        Else 0, with no collective: every rank checks at the same steps."""
        if not (logging_step or step >= self.next_check):
            return 0
        # MAXes of [the signal here or 0, -(steps to this rank's next check)]
        agreed = torch.tensor([self.received, -self.steps], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        self.agreed, minus_fewest = agreed.tolist()  # one sync
        fewest = -minus_fewest  # the fewest steps any rank proposed
        now = time.monotonic()
        if self.clock and step > self.clock[1]:  # SECONDS' worth, at most twice as many
            seconds_per_step = max(now - self.clock[0], 1e-9) / (step - self.clock[1])
            self.steps = int(max(1, min(2 * fewest, self.SECONDS / seconds_per_step, 1e6)))
        self.clock, self.next_check = (now, step), step + fewest
        return self.agreed

    def stopped(self, step, total_steps, checkpoint_dir):
        """The Stopped to raise: exit code 128 + the signal, which schedulers requeue."""
        if checkpoint_dir:
            saved = f"checkpoint step-{step} is in {checkpoint_dir}; the same command resumes there"
        else:
            saved = "nothing was saved (no --checkpoint-dir)"
        name = signal.Signals(self.agreed).name
        line = f"stopped by {name} at step {step} of {total_steps}: {saved}"
        return Stopped(line, 128 + self.agreed)
