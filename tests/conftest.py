"""Fixtures: MNIST-format files made by the test, and launchers for the real scripts.

Every launch runs in its own process group with a hard timeout: on a timeout the whole group
(torchrun and its workers) is killed and the test fails, so nothing in the suite can hang.
"""

import atexit
import faulthandler
import fcntl
import io
import json
import logging
import math
import os
import re
import runpy
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import pytest

# One intra-op thread, as in every launch (child_env): and no OpenMP thread pool here, which a fork
# (Fork) could not use.
os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models import BabyCNN, data  # noqa: E402

TIMEOUT = 240  # seconds for one launch; a healthy one takes 5 to 40 here


# pytest-xdist hands out whole files (--dist loadfile, pytest.ini) in the order they were collected:
# the longest go first (by --durations, in seconds of launches), so that none starts last while the
# other worker has nothing left. Each of CI's stages (-m) has its own longest files.
LONGEST_FIRST = {
    "not slow": [
        "test_checkpoint.py",
        "test_faults.py",
        "test_launch.py",
        "test_pippy.py",
        "test_bad_input.py",
        "test_fsdp.py",
        "test_cluster.py",
        "test_ddp.py",
        "test_hardening.py",
        "test_progress.py",
    ],
    "pages": [
        "test_benchmark.py",
        "test_exercises.py",
        "test_exercises_later.py",
        "test_bytes.py",
        "test_code_on_page.py",
        "test_collectives.py",
    ],
    "slow and not pages": [  # at load 20 here: 920, 550, 460, 400, 375, 330, 325 ... s
        "test_compile.py",
        "test_cluster.py",
        "test_template.py",
        "test_gpt_training.py",
        "test_init_from.py",
        "test_faults.py",
        "test_hf_init.py",
        "test_ddp.py",
        "test_node.py",
        "test_memory_init.py",
        "test_host_work.py",
        "test_hf_llama.py",
        "test_tp.py",
        "test_pippy.py",
        "test_checkpoint.py",
        "test_bad_input.py",
        "test_consolidate.py",
        "test_launch.py",
    ],
}


def pytest_collection_modifyitems(config, items):
    stage = config.getoption("markexpr")
    longest = LONGEST_FIRST.get(stage, LONGEST_FIRST["not slow"])
    last = len(longest)  # the other files keep their order, after these
    items.sort(
        key=lambda item: longest.index(item.path.name) if item.path.name in longest else last
    )


def child_env(**extra):
    env = dict(os.environ)
    env.pop(
        "RANK", None
    )  # a test may itself run under a launcher; the children must not inherit it
    # The suite runs on CPUs with gloo on every machine, a GPU node included (tests/test_gpu.py is
    # the GPU suite): hidden GPUs make --device auto pick the CPU.
    env.update(
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES=""
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Run:
    def __init__(self, args, env=None, cwd=None, fork=False):
        """Start ``args``; with ``fork``, ``args`` is ``[python, script, ...]`` or ``[python, -m,
        module, ...]``, run in a fork of this process (Fork)."""
        self.args = [str(a) for a in args]
        if fork:
            self.process = Fork(self.args, env or child_env(), cwd or ROOT)
        else:
            self.process = subprocess.Popen(
                self.args,
                cwd=cwd or ROOT,
                env=env or child_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                # not in pytest's process group: a Ctrl-C reaches pytest only
                start_new_session=True,
            )
        self.started = time.monotonic()
        self._chunks = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for chunk in iter(lambda: self.process.stdout.read1(4096), b""):
            self._chunks.append(chunk)

    @property
    def output(self):
        return b"".join(self._chunks).decode(errors="replace")

    def kill(self):
        """SIGKILL the launch and every process below it. torchrun starts each worker in a session
        of its own, so killing the process group alone would leave the workers running."""
        for pid in [*descendants(self.process.pid), self.process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout=TIMEOUT):
        try:
            self.process.wait(timeout=max(1, timeout - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.kill()
            self.process.wait()
            self._reader.join(5)
            pytest.fail(f"timed out after {timeout}s: {' '.join(self.args)}\n{self.output[-3000:]}")
        self._reader.join(10)
        self.seconds = time.monotonic() - self.started
        self.returncode = self.process.returncode
        return self

    def wait_for_text(self, text, timeout=TIMEOUT):
        """Wait until the launch prints ``text``; fail, saying what was awaited, if it ends first or
        takes ``timeout`` s from its start."""
        while text not in self.output:
            if self.process.poll() is not None:
                self._reader.join(10)  # its last lines may still be in the pipe
                if text in self.output:
                    return
            if self.process.poll() is not None or time.monotonic() - self.started > timeout:
                self.kill()
                pytest.fail(f"never printed {text!r}: {' '.join(self.args)}\n{self.output[-3000:]}")
            time.sleep(0.1)


class Fork:
    """What Run uses of subprocess.Popen, for ``python script args`` or ``python -m module args``
    run in a fork of this process: the same files run as __main__, in a process of its own (its own
    session, environment, directory, stdout and stderr on one pipe, exit code), without the 2 to 3 s
    of CPU a new interpreter spends importing torch, which is imported here already. The suite's
    cost is mostly such imports (a launch's ranks, torchrun's agent)."""

    def __init__(self, args, env, cwd):
        assert not dist.is_initialized()  # a process group would be the fork's too
        read, write = os.pipe()
        with (
            warnings.catch_warnings()
        ):  # Python 3.12's: this process has threads (Run's readers), which the fork
            warnings.simplefilter(
                "ignore", DeprecationWarning
            )  # leaves behind, and none of whose locks it takes
            self.pid, self.returncode = os.fork(), None
        if self.pid == 0:
            os.close(read)
            os._exit(self._main(args, env, cwd, write))  # never back into pytest
        os.close(write)
        self.stdout = open(read, "rb")

    @staticmethod
    def _main(args, env, cwd, write):
        """In the fork: what a new interpreter does for ``args``, down to the exit code, with what
        pytest changed in this process undone: its stdout and stderr, signal handlers, warning
        filters, log handlers, exit handlers."""
        try:
            os.setsid()  # not in pytest's process group: a Ctrl-C reaches pytest only
            for fd in (1, 2):
                os.dup2(write, fd)
            sys.stdout, sys.stderr = (
                io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True)
                for fd in (1, 2)
            )
            faulthandler.disable()
            for number in set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP}:
                if (
                    callable(signal.getsignal(number))
                    and signal.getsignal(number) is not signal.default_int_handler
                ):
                    signal.signal(
                        number, signal.SIG_DFL
                    )  # as exec leaves them (ignored ones stay ignored)
            # then the interpreter's default filters, as `python` starts with
            warnings.resetwarnings()
            for category in (
                ResourceWarning,
                ImportWarning,
                PendingDeprecationWarning,
                DeprecationWarning,
            ):
                warnings.simplefilter("ignore", category)
            warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
            warnings.showwarning = _print_warning
            # pytest's capture: torchrun's log lines go to stderr again
            logging.root.handlers.clear()
            logging.root.setLevel(logging.WARNING)
            atexit._clear()  # pytest's own; the script's run below, as at an interpreter's exit
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
            torch.set_num_threads(
                int(env["OMP_NUM_THREADS"])
            )  # a new interpreter reads it at torch's import
            try:
                if args[1] == "-m":
                    sys.argv = [args[2], *args[3:]]
                    runpy.run_module(args[2], run_name="__main__", alter_sys=True)
                else:
                    sys.argv, sys.path[0] = args[1:], os.path.dirname(os.path.abspath(args[1]))
                    runpy.run_path(args[1], run_name="__main__")
            finally:
                atexit._run_exitfuncs()
            return 0
        except SystemExit as exit:  # as the interpreter reads it
            if exit.code is None or isinstance(exit.code, int):
                return exit.code or 0
            print(exit.code, file=sys.stderr)
            return 1
        except BaseException:
            traceback.print_exc()
            return 1

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = time.monotonic() + (math.inf if timeout is None else timeout)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.pid, timeout)
            time.sleep(0.02)
        return self.returncode


def _print_warning(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


# Fork only where this process sees no GPU: a fork could not hide one (torch has counted them here
# already).
FORKS = torch.cuda.device_count() == 0


def forks(env):
    """Whether a launch with ``env`` may run in a fork: where it imports this repository's files, as
    this process."""
    return FORKS and (env or {}).get("PYTHONPATH", str(ROOT)) == str(ROOT)


def torchrun(script, nproc, *args, env=None):
    """Start ``torchrun --standalone --nproc-per-node=nproc script args`` (not waited for):
    torchrun's agent in a fork where it may be one (forks), its workers new processes."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        ROOT / script,
    ]
    return Run(command + list(args), env=env, fork=forks(env))


def python(script, *args, env=None, fork=True):
    """Start ``python script args``: one process, no torchrun, in a fork where it may be one
    (forks), unless ``fork`` is False: a new interpreter, as a user's, where what importing torch
    prints counts."""
    return Run([sys.executable, ROOT / script, *args], env=env, fork=fork and forks(env))


def launch(script, processes, *args, env=None):
    """As a user launches it: ``bash run_*.sh`` with NPROC_PER_NODE=processes, or plain python for
    one process (torchrun's agent costs a process)."""
    if processes > 1:
        return run_sh(script, processes, *args, env=env)
    return python(script, *args, env=env)


def run_sh(script, processes, *args, env=None):
    """Start ``NPROC_PER_NODE=processes bash run_ddp.sh args`` (run_fsdp.sh, run_pippy.sh: the
    script's own)."""
    env = with_this_pythons_torchrun({**(env or child_env()), "NPROC_PER_NODE": str(processes)})
    return Run(
        ["bash", ROOT / script.replace("train_", "run_").replace(".py", ".sh"), *args], env=env
    )


def succeeded(run):
    run.wait()
    assert run.returncode == 0, f"exit code {run.returncode}:\n{run.output[-4000:]}"
    return run


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_idx(path, tensor):
    """IDX format as MNIST ships it: magic (0, 0, 0x08 = uint8, ndim), big-endian dims, raw
    bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, tensor.dim()) + struct.pack(
        f">{tensor.dim()}I", *tensor.shape
    )
    path.write_bytes(header + tensor.to(torch.uint8).contiguous().numpy().tobytes())


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory):
    """A data dir holding MNIST/raw/ with the first 640 training and 300 test images of the real
    MNIST (the files that ship in models/mnist/): real digits, small enough for runs of seconds."""
    root = tmp_path_factory.mktemp("data")
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (train_x, train_y), (test_x, test_y) = data.find("auto", None, download=False)["splits"]
    for prefix, images, labels, count in (
        ("train", train_x, train_y, 640),
        ("t10k", test_x, test_y, 300),
    ):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images[:count, 0])
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels[:count])
    return root


# SGD with momentum, a warmup and gradient clipping (every step's gradient norm is above 1 here, 7.9
# or more, so the norm of the whole model over all ranks and stages scales every step), crossing an
# epoch boundary (20 steps per epoch at global batch 32), in float64. Equivalent layouts do the same
# math in another summation order (half-batches, then an all-reduce, a reduce-scatter,
# microbatches). In float32 that order leaves ~1e-7 differences, and an activation that close to a
# ReLU or max-pool kink takes the other branch on one side: one such flip moves a layer's gradient
# by ~1e-4 of its size, and later steps amplify it (measured here: 1e-6 after 2 steps, 3e-4 after 3,
# 8e-4 after 6 with ATEN_CPU_CAPABILITY=default). Which CPU, kernel and seed flips is chance. In
# float64 the order leaves ~1e-16, no flip is in reach, and 24 steps stay far from chaos, so the
# tolerance can be tight and the same on every machine.
EQUIVALENCE = [
    "--precision",
    "fp64",
    "--optimizer",
    "sgd",
    "--lr",
    "0.01",
    "--warmup-steps",
    "5",
    "--max-steps",
    "24",
    "--log-every",
    "8",
    "--max-grad-norm",
    "1",
]
# Relative to how far training moved the weights: equivalent runs end ~1e-14 apart, a real mistake
# (one rank's half-batch alone, the wrong gradient scale) 0.1 to 1 apart.
TOLERANCE = 1e-9
CONTROL_FLOOR = 1e-2  # the negative control must differ at least this much: 1e7 x the tolerance


def mnist_args(mnist_dir):
    return ["--dataset", "mnist", "--data-dir", mnist_dir, "--no-download"]


def made_once(tmp_path_factory, name, make):
    """A directory that ``make(directory)`` fills once in a session, for every pytest-xdist worker:
    the first to ask makes it, under a file lock, while another waits for it instead of launching
    the same run."""
    root = tmp_path_factory.getbasetemp()
    root = (
        root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    )  # the workers' common directory
    directory = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if make fails
        if not (directory / "made").exists():
            shutil.rmtree(directory, ignore_errors=True)  # a failed attempt's leftovers
            directory.mkdir()
            make(directory)
            (directory / "made").touch()
    return directory


@pytest.fixture(scope="session")
def reference_run(mnist_dir, tmp_path_factory):
    """train_ddp.py, one process without torchrun, batch 32: what every equivalent run must
    reach."""
    return made_once(
        tmp_path_factory,
        "reference",
        lambda directory: succeeded(
            python(
                "train_ddp.py",
                *mnist_args(mnist_dir),
                *EQUIVALENCE,
                "--batch-size",
                "32",
                "--save",
                directory / "reference.pt",
                "--metrics",
                directory / "reference.json",
            )
        ),
    )


@pytest.fixture(scope="session")
def reference(reference_run):
    """The reference run's final weights."""
    return load_weights(reference_run / "reference.pt")


@pytest.fixture(scope="session")
def control(mnist_dir, tmp_path_factory):
    """The negative control: one process at batch 16, what one rank computes if nothing averages
    its gradients with the other rank's; every equivalence test checks it is far off."""
    directory = made_once(
        tmp_path_factory,
        "control",
        lambda directory: succeeded(
            python(
                "train_ddp.py",
                *mnist_args(mnist_dir),
                *EQUIVALENCE,
                "--batch-size",
                "16",
                "--save",
                directory / "half_batch.pt",
            )
        ),
    )
    return load_weights(directory / "half_batch.pt")


@pytest.fixture(scope="session")
def reference_metrics(reference_run):
    """The reference run's metrics: its logged loss curve and test accuracy."""
    return json.loads((reference_run / "reference.json").read_text())


def load_weights(path):
    return torch.load(path, weights_only=True)


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def relative_difference(weights, reference, initial=None):
    """||weights - reference|| / ||reference - initial||, over all tensors: 0 for the same run,
    about 1 for a run that went elsewhere. The initial weights: BabyCNN's for --seed 0, unless
    given."""
    assert weights.keys() == reference.keys()
    if initial is None:
        torch.manual_seed(0)
        initial = BabyCNN().state_dict()
    apart = sum(((weights[k].double() - reference[k].double()) ** 2).sum() for k in reference)
    moved = sum(((reference[k].double() - initial[k].double()) ** 2).sum() for k in reference)
    return (apart / moved).sqrt().item()


def assert_same_math(weights, reference, control):
    """``weights`` came from the same computation as ``reference``, in another summation order.

    The negative control shows, in the same test, that the tolerance is far below a real mistake."""
    assert relative_difference(control, reference) > CONTROL_FLOOR
    assert relative_difference(weights, reference) < TOLERANCE


GLOO_START_UP = re.compile(
    r"\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :"
)


def our_lines(output):
    """The lines of a launch's output the project printed: not launch.sh's torchrun command, nor
    torch 2.9's gloo start-up lines ("[Gloo] Rank N is connected to N peer ranks. Expected number of
    connected peer ranks is : N"), which each rank writes a piece at a time, so that two ranks'
    pieces interleave anywhere: its words go, and then the lines left with nothing but numbers."""
    lines = GLOO_START_UP.sub("", output).splitlines()
    return [
        line
        for line in lines
        if line.strip(" 0123456789") and not line.startswith("launch.sh: torchrun")
    ]


def assert_one_line_error(run, message):
    """A bad-input run: exit code 2, one `error:` line (from rank 0), the last, and no traceback or
    torchrun log line (torch 2.9's gloo start-up lines are not ours, and a rank's may come after
    another's error line: our_lines)."""
    lines = our_lines(run.output)
    errors = [line for line in lines if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1 and lines[-1] == errors[0], run.output
    assert message in errors[0], errors[0]
    assert not [
        line
        for line in lines
        if line.startswith(("Traceback", "[rank")) or re.match(r"[EWI]\d{4} ", line)
    ], run.output


def _parents():
    """{pid: parent pid} of every process, read from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return parents


def wait_for(path, *runs, timeout=120):
    """Wait until ``path`` exists; fail (and kill the runs) if one of them ends first or it takes
    too long."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if any(run.process.poll() is not None for run in runs) or time.monotonic() > deadline:
            for run in runs:
                run.kill()
            pytest.fail(f"{path} never appeared:\n" + "\n".join(run.output[-3000:] for run in runs))
        time.sleep(0.05)


def alive(pid):
    """True while ``pid`` runs (a zombie, dead but not yet reaped by its new parent, counts as
    gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid):
    parents, found, frontier = _parents(), [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def worker_pids(parent):
    """torchrun's worker processes (its children), by the RANK in their environment."""
    workers = {}
    for pid, parent_pid in _parents().items():
        if parent_pid != parent:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"RANK" in environ:
            workers[int(environ[b"RANK"])] = pid
    return workers


def launcher_env(**extra):
    """Environment for a run_*.sh launch: torchrun must be this Python's."""
    return with_this_pythons_torchrun(child_env(**extra))


def with_this_pythons_torchrun(env):
    """``env`` with this Python's bin directory first on its PATH, where launch.sh finds
    torchrun."""
    return {**env, "PATH": os.path.dirname(sys.executable) + os.pathsep + env["PATH"]}
