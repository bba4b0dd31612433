"""Faults a real cluster makes: a peer lost while the others load or save a checkpoint is retried, a
diverged run saves nothing non-finite, every stop signal torchrun passes on stops every rank within
about a second, with a checkpoint."""

import csv
import errno
import hashlib
import json
import math
import os
import re
import shutil
import signal
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from conftest import (
    ROOT,
    Run,
    assert_one_line_error,
    launch,
    launcher_env,
    load_weights,
    max_difference,
    mnist_args,
    succeeded,
    torchrun,
    wait_for,
    worker_pids,
)

from plumbing import checkpoint_dir, failures, metrics

# A model of 7 M parameters (--width 16; 28 MB of weights, as much of SGD's momentum): a checkpoint
# big enough that reading or writing it takes tens of milliseconds, which a poll of the workers'
# open files every millisecond finds.
BIG = [
    "--width",
    "16",
    "--optimizer",
    "sgd",
    "--batch-size",
    "4",
    "--max-steps",
    "4",
    "--checkpoint-every",
    "2",
    "--log-every",
    "2",
    "--no-eval",
]


def open_files(pid):
    try:
        return [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:  # it exited, or closed a file between the two calls
        return []


def kill_rank_1_when_it_opens(run, pattern, timeout=120):
    """SIGKILL rank 1 of ``run`` (a launcher) the moment it holds a file whose path matches
    ``pattern`` open."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.process.poll() is None:
        pid = worker_pids(run.process.pid).get(1)
        if pid and any(re.search(pattern, path) for path in open_files(pid)):
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.001)
    run.kill()
    pytest.fail(f"rank 1 never opened {pattern}:\n{run.output[-3000:]}")


@pytest.fixture(scope="module")
def big_uninterrupted(mnist_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("big")
    succeeded(
        torchrun(
            "train_ddp.py",
            2,
            *mnist_args(mnist_dir),
            *BIG,
            "--checkpoint-dir",
            directory / "ck",
            "--save",
            directory / "final.pt",
        )
    )
    return directory


@pytest.mark.slow  # in CI's slow stage, for the README's 8 minutes (50 to 100 s, load and save)
@pytest.mark.parametrize("window", ["load", "save"])
def test_a_peer_lost_while_the_others_load_or_save_a_checkpoint_is_retried(
    window, big_uninterrupted, mnist_dir, tmp_path
):
    """Rank 1 is killed while it reads its part of step-2 (resuming) or writes its part of step-4:
    the job restarts (MAX_RESTARTS=1), resumes from step-2 and ends bitwise as the uninterrupted
    run. The old plumbing called any failure in DCP's load "damaged? move it away" and exited 2,
    which turned torchrun's restarts off."""
    checkpoints = tmp_path / "ck"
    if window == "load":  # the uninterrupted run's step-2 alone: the launch resumes from it
        shutil.copytree(big_uninterrupted / "ck" / "step-2", checkpoints / "step-2")
    run = Run(
        [
            "bash",
            ROOT / "run_ddp.sh",
            *mnist_args(mnist_dir),
            *BIG,
            "--checkpoint-dir",
            checkpoints,
            "--save",
            tmp_path / "final.pt",
        ],
        env=launcher_env(NPROC_PER_NODE=2, MAX_RESTARTS=1),
    )
    kill_rank_1_when_it_opens(
        run, r"/ck/step-2/.*\.distcp$" if window == "load" else r"/ck/\.tmp-step-4/"
    )
    succeeded(run)
    # the restart says why, from the failed attempt: which rank, what, attempt k of n
    restart = re.search(
        r"^attempt 1 of 2 failed: rank 1 \(pid \d+\) on \S+ was killed by SIGKILL; torchrun "
        r"restarts the workers \(attempt 2 of 2\)$",
        run.output,
        re.MULTILINE,
    )
    assert restart and run.output.count("attempt 1 of 2 failed") == 1, run.output
    assert "(torchrun restart 1)" not in run.output or "error:" not in run.output, run.output
    assert "damaged" not in run.output and "fix that" not in run.output, run.output
    resumed = [line for line in run.output.splitlines() if "resumed from" in line]
    assert resumed and resumed[-1].startswith(f"resumed from {checkpoints}/step-2 "), run.output
    assert (
        max_difference(
            load_weights(tmp_path / "final.pt"), load_weights(big_uninterrupted / "final.pt")
        )
        == 0
    )


def test_a_run_that_diverges_between_checkpoints_saves_nothing_non_finite(mnist_dir, tmp_path):
    """SGD at lr 10 diverges within a few steps (at step 4 here). Checkpoints every 2 steps, the
    loss logged every 3: the old plumbing checked only the logged loss, and saved the NaN weights of
    the checkpoints in between, which every resume then started from. Now no checkpoint holds a
    non-finite value, the one line names the newest (finite) one, and a rerun resumes from it and
    stops the same way: no loop of resumes into a NaN."""
    checkpoints, log_dir = tmp_path / "ck", tmp_path / "log"
    args = [
        *mnist_args(mnist_dir),
        "--optimizer",
        "sgd",
        "--lr",
        "10",
        "--warmup-steps",
        "0",
        "--lr-schedule",
        "constant",
        "--batch-size",
        "16",
        "--max-steps",
        "40",
        "--checkpoint-every",
        "2",
        "--log-every",
        "3",
        "--checkpoint-dir",
        checkpoints,
        "--log-dir",
        log_dir,
    ]
    for attempt in range(2):
        run = launch("train_ddp.py", 2, *args).wait()
        assert_one_line_error(run, ": training diverged; lower --lr or raise --warmup-steps")
        saved = sorted((int(p.name[5:]) for p in checkpoints.glob("step-*")), reverse=True)
        line = next(line for line in run.output.splitlines() if line.startswith("error:"))
        step = int(re.search(r" at step (\d+): training diverged", line).group(1))
        if saved:
            assert (
                f"nothing after step-{saved[0]} was saved; the same command resumes from "
                f"{checkpoints}/step-{saved[0]}"
                in line
                and saved[0] < step
            ), line
        else:
            assert f"no checkpoint is in {checkpoints}" in line, line
        assert attempt == 0 or f"resumed from {checkpoints}/step-{saved[0]} " in run.output, (
            run.output
        )
        for path in checkpoints.glob("step-*"):
            metadata = dcp.FileSystemReader(path).read_metadata()
            state = {
                key: torch.empty(meta.size, dtype=meta.properties.dtype)
                for key, meta in metadata.state_dict_metadata.items()
                if hasattr(meta, "size")
            }
            dcp.load(state, checkpoint_id=path, no_dist=True)
            assert all(t.isfinite().all() for t in state.values() if t.is_floating_point()), path
        # --log-dir's CSV is closed whole however the run ended: its last line is a complete row
        with open(log_dir / "metrics.csv", newline="") as file:
            rows = list(csv.DictReader(file))
        assert (
            rows and None not in rows[-1].values() and math.isfinite(float(rows[-1]["train_loss"]))
        ), rows
    assert saved, "the run diverged before its first checkpoint: lower --lr in this test"


@pytest.mark.parametrize(
    "number",
    [
        signal.SIGTERM,
        *(pytest.param(n, marks=pytest.mark.slow) for n in (signal.SIGHUP, signal.SIGQUIT)),
    ],
    ids=lambda n: n.name,
)
def test_every_stop_signal_stops_every_rank_within_about_a_second_with_a_checkpoint(
    number, tmp_path
):
    """SIGTERM, SIGHUP and SIGQUIT to the launcher (SIGINT and SIGUSR1: test_cluster.py), with
    --log-every larger than the run: torchrun passes each on, and the ranks agree on it within about
    a second of training. The signal is sent when step-20's checkpoint appears; the stop must come
    within 3 seconds' steps of it (the agreement's bound is one second, its interval at most
    doubles, and the poll here adds some), by the run's own rate. The old plumbing stopped at the
    next logging step (the end of the run here); SIGHUP and SIGQUIT killed the workers unsaved."""
    # The bundled MNIST: 60,000 images, 1,875 steps an epoch at global batch 32
    run = Run(
        [
            "bash",
            ROOT / "run_ddp.sh",
            "--batch-size",
            "16",
            "--max-steps",
            "5000",
            "--log-every",
            "100000",
            "--checkpoint-every",
            "20",
            "--checkpoint-dir",
            tmp_path / "ck",
            "--log-dir",
            tmp_path / "log",
            "--no-eval",
        ],
        env=launcher_env(NPROC_PER_NODE=2),
    )
    wait_for(tmp_path / "ck" / "step-20", run)
    run.process.send_signal(number)
    run.wait()
    assert run.returncode == 128 + number, run.output
    stopped = re.search(
        rf"stopped by {number.name} at step (\d+) of \d+: checkpoint step-(\d+) is in", run.output
    )
    assert stopped and stopped.group(1) == stopped.group(2), run.output
    step = int(stopped.group(1))
    assert (tmp_path / "ck" / f"step-{step}" / "checkpoint.json").exists()
    # The stop's own row closes the CSV: the loss since the last row, and the rate, at the stop step
    with open(tmp_path / "log" / "metrics.csv", newline="") as file:
        last = list(csv.DictReader(file))[-1]
    steps_per_second = float(last["samples_per_second"]) / 32
    assert int(last["step"]) == step and math.isfinite(float(last["train_loss"])), last
    assert 20 < step <= 20 + 3 * steps_per_second + 2, (step, steps_per_second)


def test_the_launcher_passes_on_the_signals_the_workers_catch():
    text = (ROOT / "launch_torchrun.py").read_text()
    early = re.search(r"for number in \((signal\.SIG\w+(?:, signal\.SIG\w+)*)\):", text).group(1)
    assert (
        tuple(getattr(signal, name.split(".")[1]) for name in early.split(", "))
        == failures.STOP_SIGNALS
    )
    assert {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT} == set(
        failures.STOP_SIGNALS
    )


def test_mfu_is_one_gpus_flops_over_its_peak():
    """8 ranks of bf16 on H100s at 1,000 samples/s of 1e12 FLOPs each: 1e15 FLOP/s in all, 1.25e14 a
    GPU, 12.6 % of the H100's 989e12 (the old arithmetic divided the total by one GPU's peak: 8 x
    too much)."""
    cpu = torch.device("cpu")
    figures = metrics.throughput(1e12, 1000.0, 8, cpu, "bf16", gpu_name="NVIDIA H100 80GB HBM3")
    assert figures["flops_per_second"] == 1e15 and figures["flops_per_second_per_gpu"] == 1.25e14
    assert figures["peak_flops_per_gpu"] == 989e12 and figures["mfu"] == pytest.approx(
        1.25e14 / 989e12, rel=1e-12
    )
    assert (
        metrics.throughput(1e12, 1000.0, 8, cpu, "fp32", gpu_name="NVIDIA H100 80GB HBM3")["mfu"]
        is None
    )
    assert metrics.throughput(1e12, 1000.0, 1, cpu, "bf16")["mfu"] is None  # no GPU: no peak


SECTION = """
import torch.distributed as dist
from plumbing import failures

dist.init_process_group("gloo")
try:
    failures.on_rank_0(lambda: [] + None, "in a test")
except Exception as error:
    print(f"rank {dist.get_rank()}: {type(error).__name__}: {error}", flush=True)
dist.barrier()  # both ranks got here: nobody was left waiting in a collective
dist.destroy_process_group()
"""


def test_whatever_rank_0_raises_in_its_section_the_others_raise_at_once(tmp_path):
    """A bug (a TypeError) in a rank-0-only section: rank 0 says its traceback, and every rank
    raises with the same one line at once, instead of waiting in the next collective for the
    10-minute timeout."""
    script = tmp_path / "section.py"
    script.write_text(SECTION)
    run = succeeded(torchrun(script, 2))
    for rank in (0, 1):  # (the two ranks' lines may interleave in the pipe)
        assert (
            f"rank {rank}: RuntimeError: rank 0 failed in a test: TypeError: can only concatenate "
            'list (not "NoneType") to list'
        ) in run.output, run.output


def test_a_damaged_checkpoint_set_aside_never_takes_a_name_in_use(tmp_path):
    for name in ("damaged-step-4", "damaged-step-4-2"):
        (tmp_path / name).mkdir()
    assert checkpoint_dir.unused_path(str(tmp_path / "damaged-step-4")) == str(
        tmp_path / "damaged-step-4-3"
    )
    assert checkpoint_dir.unused_path(str(tmp_path / "damaged-step-8")) == str(
        tmp_path / "damaged-step-8"
    )


def test_a_checksum_finds_every_flipped_byte_and_old_sha256_checkpoints_still_verify(tmp_path):
    """checkpoint_dir.verify on real files: a byte flipped at either end, in the middle and at a
    block's edge, a lost or a zero byte more, a swap of two blocks: each is damage; an intact
    checkpoint is not. A checkpoint.json of format 4 (SHA-256s, before the block sums) verifies by
    its SHA-256s, and is damaged by the same flips; an unknown format is named."""
    block = checkpoint_dir.BLOCK
    data = bytes(torch.randint(0, 256, (3 * block + 5,), dtype=torch.uint8).tolist())
    layout = {"dataset": "synthetic", "optimizer": None}
    for folder, format_, digest in [
        ("new", checkpoint_dir.FORMAT, None),
        ("old", 4, lambda raw: hashlib.sha256(raw).hexdigest()),
    ]:
        path = tmp_path / folder
        path.mkdir()
        (path / ".metadata").write_bytes(b"metadata")
        (path / "__0_0.distcp").write_bytes(data)
        files = {}
        for name in (".metadata", "__0_0.distcp"):
            raw = (path / name).read_bytes()
            files[name] = (
                [len(raw), digest(raw)] if digest else checkpoint_dir._fingerprint(path / name)
            )
        info = {"format": format_, "layout": layout, "files": files}
        info |= {} if digest else {"checksum": checkpoint_dir.CHECKSUM}
        (path / "checkpoint.json").write_text(json.dumps(info))
        assert checkpoint_dir.verify(path)[1] is None, folder  # intact
        assert checkpoint_dir.verify(path)[0]["checksum"] == ("sha256" if digest else "block-sums")
        swapped = data[block : 2 * block] + data[:block] + data[2 * block :]
        damaged = [swapped, data[:-1], data + bytes(1)]
        for at in (0, block - 1, block, len(data) // 2, len(data) - 1):
            for bit in (0, 7):
                flipped = bytearray(data)
                flipped[at] ^= 1 << bit
                damaged.append(bytes(flipped))
        for bad in damaged:
            (path / "__0_0.distcp").write_bytes(bad)
            problem = checkpoint_dir.verify(path)[1]
            assert problem in (
                "__0_0.distcp does not match its checksum in checkpoint.json",
                f"__0_0.distcp has {len(bad)} bytes, checkpoint.json says {len(data)}",
            ), (folder, problem)
            assert ("bytes" in problem) == (len(bad) != len(data)), problem
    (tmp_path / "new" / "checkpoint.json").write_text(json.dumps(info | {"format": 6}))
    problem = checkpoint_dir.verify(tmp_path / "new")[1]
    assert problem.startswith(
        "checkpoint.json is unreadable: format 6, checksum None (this code reads 4 with sha256 "
        "and 5 with block-sums)"
    ), problem


def accelerator_error(text, code=None):
    """A CUDA error as torch raises it (torch.AcceleratorError, from 2.8) with CUDA's own words:
    what a device-side assert or a lost GPU raises on a GPU, made here on any machine."""
    error = torch.AcceleratorError(
        f"CUDA error: {text}\nCUDA kernel errors might be asynchronously"
    )
    if code is not None:
        error.error_code = code  # as torch sets it: CUDA's cudaError_t
    return error


def raised(work):
    try:
        work()
    except Exception as error:
        return error
    raise AssertionError("nothing raised")


class SlowSample(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        time.sleep(1.5)  # past the DataLoader's timeout below; then the worker ends cleanly


# Each class of failure: (the error, exit code 75's line or 2's, or None for neither: a crash's
# traceback, exit 1). Retried by its type, never by words in its text.
KINDS = {
    "dist-network-error": (lambda: torch.distributed.DistNetworkError("Broken pipe"), 75),
    "dist-store-error": (lambda: torch.distributed.DistStoreError("wait timeout after 600s"), 75),
    "dist-backend-error": (lambda: torch.distributed.DistBackendError("NCCL error: remote"), 75),
    # gloo raises plain RuntimeErrors, marked by its source file (a peer lost, test_launch.py)
    "gloo": (
        lambda: RuntimeError(
            "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
            "waiting 2000ms for recv operation to complete"
        ),
        75,
    ),
    "io-error": (lambda: OSError(errno.EIO, "Input/output error"), 75),
    "full-disk": (lambda: OSError(errno.ENOSPC, "No space left on device"), None),
    "ecc": (lambda: accelerator_error("uncorrectable ECC error encountered", 214), 75),
    "lost-gpu": (lambda: accelerator_error("no CUDA-capable device is detected", 100), 75),
    # the issue's own: torch 2.8's AcceleratorError with CUDA's words, and with its error code
    "device-side-assert": (lambda: accelerator_error("device-side assert triggered"), 2),
    "device-side-assert-code": (lambda: accelerator_error("device-side assert triggered", 710), 2),
    "illegal-memory-access": (
        lambda: accelerator_error("an illegal memory access was encountered", 700),
        2,
    ),
    # on a CPU, the same bad token id: IndexError
    "index-error": (lambda: raised(lambda: torch.nn.Embedding(65, 4)(torch.tensor([70]))), 2),
    # an index of the user's own code: a bug, with no guess at data
    "list-index": (lambda: raised(lambda: [][1]), 2),
    "label-out-of-range": (
        lambda: raised(lambda: F.cross_entropy(torch.zeros(2, 10), torch.tensor([3, 12]))),
        2,
    ),
    # words that used to mean "a collective failed", in errors that are not one
    "words-alone": (lambda: RuntimeError("the NCCL Socket timed out: Connection gloo"), None),
    "out-of-memory": (lambda: torch.OutOfMemoryError("CUDA out of memory"), None),
    # the DataLoader's own: a worker that timed out
    "dataloader-timeout": (
        lambda: raised(
            lambda: next(
                iter(torch.utils.data.DataLoader(SlowSample(), num_workers=1, timeout=0.5))
            )
        ),
        75,
    ),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_failure_is_retried_by_its_type_never_by_its_text(kind):
    make, exit_code = KINDS[kind]
    error = make()
    retry, bug = failures.transient(error), failures.bug_or_bad_data(error)
    assert (retry is not None, bug is not None) == (exit_code == 75, exit_code == 2), (retry, bug)
    if kind == "list-index":
        assert bug.startswith("IndexError: list index out of range, at tests/test_faults.py:")
        assert bug.endswith(" (<lambda>): a bug or bad data, which a retry repeats (not retried)")
    elif exit_code == 2:
        assert bug.endswith(
            ": a bug or bad data, which a retry repeats (not retried): most likely a token id "
            "outside the model's vocabulary, or a label outside its classes"
            + ("; CUDA_LAUNCH_BLOCKING=1 makes the error name the operation that raised it")
            * kind.startswith(("device", "illegal"))
        ), bug
    if kind == "device-side-assert":  # one line, CUDA's first
        assert bug.startswith("CUDA error: device-side assert triggered: a bug or bad data"), bug
    if kind == "index-error":  # where, in the caller's code: this file
        assert bug.startswith("IndexError: index out of range in self, at tests/test_faults.py:"), (
            bug
        )
    if kind == "dataloader-timeout":
        assert retry == (
            "a DataLoader worker of this rank failed (DataLoader timed out after 0.5 seconds): "
            "slow storage, or out of memory?"
        )
    elif retry and kind.startswith(("dist", "gloo")):
        assert retry.startswith("a collective failed ("), retry
    elif retry and kind in ("ecc", "lost-gpu"):
        assert retry.startswith("the GPU failed (CUDA error: "), retry


def test_a_read_error_is_retried_only_when_it_is_the_storages():
    """The user's input and a checkpoint's files: missing, a permission, a directory in a file's
    place are the user's (exit 2); EIO and ESTALE the storage's (75). Each line names the file and
    the OS error; a DataLoader worker's re-raise (its type, called with its traceback's text) keeps
    the line alone."""
    for number in (errno.ENOENT, errno.EACCES, errno.EISDIR, errno.EIO, errno.ESTALE):
        error = OSError(number, os.strerror(number), "/data/0/100.txt")
        retry = number in (errno.EIO, errno.ESTALE)
        for made in (
            failures.input_error(error, "the data (sample 100)"),
            checkpoint_dir.unreadable("ck/step-40", error),
        ):
            assert isinstance(made, failures.Retryable) == retry, (number, made)
            assert isinstance(made, failures.UsageError) == (not retry), (number, made)
            assert "/data/0/100.txt" in str(made) and os.strerror(number) in str(made), made
        made = failures.input_error(error, "the data (sample 100)")
        try:
            raise made
        except Exception:
            wrapped = torch._utils.ExceptionWrapper(where="in DataLoader worker process 0")
        try:
            wrapped.reraise()
        except Exception as reraised:
            assert type(reraised) is type(made) and str(reraised) == str(made), str(reraised)
